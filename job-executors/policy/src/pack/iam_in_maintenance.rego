# Maintenance does not create or change IAM roles or policies: that belongs to
# provision, under the customer's eye.
package byoc.builtin.iam_in_maintenance

import rego.v1

iam_types := {
	"aws_iam_role", "aws_iam_policy", "aws_iam_role_policy", "aws_iam_role_policy_attachment",
	"aws_iam_policy_attachment", "aws_iam_user", "aws_iam_user_policy", "aws_iam_user_policy_attachment",
	"aws_iam_group_policy", "aws_iam_group_policy_attachment", "aws_iam_instance_profile",
}

deny contains v if {
	input.byoc.phase == "maintenance"
	rc := input.resource_changes[_]
	iam_types[rc.type]
	some a in rc.change.actions
	a in {"create", "update"}
	v := {"rule": "iam_in_maintenance", "address": rc.address, "msg": sprintf("%s (%s) would be %sd during maintenance", [rc.address, rc.type, a])}
}
