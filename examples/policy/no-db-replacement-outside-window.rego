# A customer policy that depends on the guardrails (docs/GUARDRAILS.md): a database
# may be replaced or deleted only while a maintenance window is open.
package main

import rego.v1

deny contains msg if {
	input.byoc.context.window == null
	some rc in input.resource_changes
	rc.type == "aws_db_instance"
	"delete" in rc.change.actions
	msg := sprintf("%s would be replaced outside a maintenance window", [rc.address])
}
