# Written before Rego v1, as many conftest policies are.
package main

deny[msg] {
	rc := input.resource_changes[_]
	rc.change.actions[_] == "delete"
	rc.type == "aws_db_instance"
	msg := sprintf("%s: database replaced", [rc.address])
}

warn[{"msg": msg, "type": rc.type}] {
	rc := input.resource_changes[_]
	rc.change.after_unknown.arn
	msg := sprintf("%s: arn known after apply", [rc.address])
}
