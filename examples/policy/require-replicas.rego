# An example conftest policy (package main, deny rules): deployments run at least two
# replicas. `byoc-runner policy test --vendor-policy examples/policy/require-replicas.rego`.
package main

import rego.v1

deny contains msg if {
	input.kind == "Deployment"
	object.get(input.spec, "replicas", 1) < 2
	msg := sprintf("Deployment %s runs fewer than 2 replicas", [input.metadata.name])
}
