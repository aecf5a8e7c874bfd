# An example vendor policy in the nuon convention: package nuon, deny over input.plan.
# `byoc-runner policy test --input examples/policy/plan-deletes-eip.json \
#   --vendor-policy examples/policy/nuon/no-eip-delete.rego`
package nuon

import rego.v1

deny contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_eip"
	"delete" in rc.change.actions
	msg := sprintf("%s: elastic IP deleted", [rc.address])
}
