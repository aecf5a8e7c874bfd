# Kubernetes CPU quantities ("250m", ".25", "2") read with to_number, as OPA reads them.
package nuon

import rego.v1

cores(q) := to_number(trim_suffix(q, "m")) / 1000 if endswith(q, "m")

cores(q) := to_number(q) if not endswith(q, "m")

limited contains c if {
	some c in input.review.object.spec.template.spec.containers
	c.resources.limits.cpu
}

deny contains msg if {
	some c in limited
	cores(c.resources.limits.cpu) > 1
	msg := sprintf("%s asks for %v cores", [c.name, cores(c.resources.limits.cpu)])
}

pass contains msg if {
	some c in limited
	cores(c.resources.limits.cpu) <= 1
	msg := sprintf("%s fits in one core", [c.name])
}
