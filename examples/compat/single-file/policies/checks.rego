# Informational checks only: each passed check is reported, none decides.
package nuon

import rego.v1

pass contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_s3_bucket"
	rc.change.after.tags.owner
	msg := sprintf("%s names its owner", [rc.address])
}

pass contains msg if {
	count([rc | some rc in input.plan.resource_changes; "delete" in rc.change.actions]) == 0
	msg := "the plan deletes nothing"
}
