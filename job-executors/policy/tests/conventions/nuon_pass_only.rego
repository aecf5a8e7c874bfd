# Informational only: `pass` rules report checks that passed and never decide.
package nuon

import rego.v1

pass contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_s3_bucket"
	rc.change.after.tags.owner
	msg := sprintf("%s has an owner", [rc.address])
}

pass contains {"msg": msg, "resource": name} if {
	input.review.kind.kind == "Deployment"
	name := input.review.object.metadata.name
	msg := sprintf("deployment %s was reviewed", [name])
}
