# Functions with several clauses and `else`, to_number, json.unmarshal, substring,
# trim_suffix, and sprintf of a set with %v.
package nuon

import rego.v1

growth(rc) := to_number(rc.change.after.allocated_storage) - to_number(rc.change.before.allocated_storage) if {
	rc.change.before.allocated_storage
} else := 0

size_class(n) := "large" if n >= 50

size_class(n) := "small" if n < 50

deny contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_db_instance"
	g := growth(rc)
	size_class(g) == "large"
	msg := sprintf("%s grows by %d GiB", [rc.address, g])
}

wildcard_statements(doc) := [s | some s in doc.Statement; s.Action == "*"]

deny contains {"msg": sprintf("%s allows every action", [rc.address]), "policy_name": rc.change.after.name} if {
	some rc in input.plan.resource_changes
	rc.type == "aws_iam_policy"
	doc := json.unmarshal(rc.change.after.policy)
	count(wildcard_statements(doc)) > 0
}

warn contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_instance"
	family := substring(rc.change.after.instance_type, 0, 2)
	family == "t3"
	msg := sprintf("%s uses burstable family %s (%s)", [rc.address, family, trim_suffix(rc.change.after.instance_type, ".large")])
}

warn contains msg if {
	types := {rc.type | some rc in input.plan.resource_changes; rc.change.actions != ["no-op"]}
	count(types) > 4
	msg := sprintf("a wide change: %v", [types])
}
