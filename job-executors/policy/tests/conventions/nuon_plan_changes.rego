# Deletions and replacements of stateful resources (nuon convention, over input.plan).
package nuon

import rego.v1

stateful := {"aws_db_instance", "aws_eip", "aws_s3_bucket"}

replaced(rc) if {
	"delete" in rc.change.actions
	"create" in rc.change.actions
}

deny contains msg if {
	some rc in input.plan.resource_changes
	rc.type in stateful
	rc.change.actions == ["delete"]
	msg := sprintf("%s: %s deleted", [rc.address, rc.type])
}

deny contains {"msg": sprintf("%s is replaced", [rc.address]), "severity": "high", "actions": rc.change.actions} if {
	some rc in input.plan.resource_changes
	replaced(rc)
}

warn contains msg if {
	some rc in input.plan.resource_changes
	rc.change.actions == ["update"]
	msg := sprintf("%s is updated in place", [rc.address])
}

warn contains {"msg": sprintf("%s: %d values known only after apply", [rc.address, count(unknown)]), "attributes": unknown} if {
	some rc in input.plan.resource_changes
	"create" in rc.change.actions
	unknown := sort([k | some k, v in rc.change.after_unknown; v == true])
	count(unknown) > 1
}
