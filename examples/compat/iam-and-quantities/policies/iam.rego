# IAM documents give Action as a string or a list, and providers leave tags null.
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
	some a in s.Action
	a == "*"
	msg := "an IAM statement allows every action"
}

deny contains msg if {
	some s in statements
	s.Action == "*"
	msg := "an IAM statement allows every action"
}

warn contains msg if {
	some rc in input.plan.resource_changes
	some key, _ in rc.change.after.tags
	key == "cost-center"
	msg := sprintf("%s is billed to a cost centre", [rc.address])
}
