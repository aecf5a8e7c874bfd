# conftest's convention over each manifest.
package main

import rego.v1

deny contains msg if {
	input.kind == "Deployment"
	input.spec.replicas < 2
	msg := sprintf("%s needs at least 2 replicas", [input.metadata.name])
}

warn contains msg if {
	input.kind == "Ingress"
	input.metadata.annotations["kubernetes.io/ingress.class"] == "public"
	msg := sprintf("%s is a public ingress", [input.metadata.name])
}
