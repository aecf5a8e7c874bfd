# An example vendor policy in the nuon convention over kubernetes objects: each object
# arrives as an admission review (input.review.object, input.review.kind.kind).
package nuon

import rego.v1

deny contains {"msg": sprintf("%s/%s: container %s is privileged", [input.review.kind.kind, input.review.object.metadata.name, c.name])} if {
	some c in object.get(input.review.object.spec, "containers", [])
	c.securityContext.privileged
}

warn contains msg if {
	input.review.operation == "DELETE"
	msg := sprintf("%s %s is being removed", [input.review.kind.kind, input.review.object.metadata.name])
}
