# `some … in` over values that are sometimes a string or null, as IAM documents and
# provider attributes are written: OPA iterates nothing there (no error).
package nuon

import rego.v1

statements contains s if {
	some rc in input.plan.resource_changes
	rc.type == "aws_iam_policy"
	doc := json.unmarshal(rc.change.after.policy)
	some s in doc.Statement
}

deny contains msg if {
	some s in statements
	some action in s.Action
	action == "*"
	msg := "a statement allows every action (in a list)"
}

deny contains msg if {
	some s in statements
	s.Action == "*"
	msg := "a statement allows every action"
}

warn contains msg if {
	some rc in input.plan.resource_changes
	some key, _ in rc.change.after.tags
	key == "cost-center"
	msg := sprintf("%s names a cost centre", [rc.address])
}

warn contains msg if {
	some rc in input.plan.resource_changes
	some rule in rc.change.after.ingress
	some cidr in rule.cidr_blocks
	cidr == "0.0.0.0/0"
	msg := sprintf("%s is open to the world", [rc.address])
}

warn contains msg if {
	some rc in input.plan.resource_changes
	every t in rc.change.after.tags {
		t != "ops"
	}
	msg := sprintf("%s: no tag says ops", [rc.address])
}
