# Comprehensions and multi-clause functions over a workload's containers.
package nuon

import rego.v1

containers := input.review.object.spec.template.spec.containers

unlimited := {c.name | some c in containers; not c.resources.limits.memory}

deny contains msg if {
	input.review.kind.kind == "Deployment"
	count(unlimited) > 0
	msg := sprintf("%s: containers without a memory limit: %s", [input.review.object.metadata.name, concat(", ", sort(unlimited))])
}

mebibytes(q) := to_number(trim_suffix(q, "Mi")) if endswith(q, "Mi")

mebibytes(q) := to_number(trim_suffix(q, "Gi")) * 1024 if endswith(q, "Gi")

warn contains msg if {
	some c in containers
	mebibytes(c.resources.limits.memory) > 512
	msg := sprintf("%s asks for %v MiB", [c.name, mebibytes(c.resources.limits.memory)])
}
