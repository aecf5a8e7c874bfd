# Written with OPA 0.x's future keywords imports, still accepted.
package nuon

import future.keywords.contains
import future.keywords.every
import future.keywords.if
import future.keywords.in

deny contains msg if {
	some rc in input.plan.resource_changes
	count(rc.change.actions) > 0
	every a in rc.change.actions {
		a == "delete"
	}
	msg := sprintf("%s is only deleted", [rc.address])
}
