# conftest's convention (package main) over the plan document itself.
package main

import rego.v1

deny contains msg if {
	some rc in input.resource_changes
	rc.type == "aws_eip"
	"delete" in rc.change.actions
	msg := sprintf("%s: elastic IP deleted", [rc.address])
}

violation contains {"msg": sprintf("%s changes in phase %s", [rc.address, input.byoc.phase]), "phase": input.byoc.phase} if {
	input.byoc.phase == "maintenance"
	some rc in input.resource_changes
	rc.type == "aws_iam_policy"
}

warn contains msg if {
	some rc in input.resource_changes
	rc.change.actions == ["no-op"]
	msg := sprintf("%s has nothing to do", [rc.address])
}
