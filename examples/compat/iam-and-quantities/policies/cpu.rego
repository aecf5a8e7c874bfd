# CPU limits in every form Kubernetes takes: "2", "0.5", ".25", "250m".
package nuon

import rego.v1

cores(q) := to_number(trim_suffix(q, "m")) / 1000 if endswith(q, "m")

cores(q) := to_number(q) if not endswith(q, "m")

deny contains msg if {
	some c in input.review.object.spec.template.spec.containers
	cores(c.resources.limits.cpu) > 1.5
	msg := sprintf("%s asks for more than 1.5 cores", [c.name])
}

pass contains msg if {
	some c in input.review.object.spec.template.spec.containers
	cores(c.resources.limits.cpu) <= 1.5
	msg := sprintf("%s fits its CPU budget", [c.name])
}
