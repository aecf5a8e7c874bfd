# Taggable resources carry the required tags (`required_tags`). With no list
# configured the rule is inactive.
package byoc.builtin.required_tags

import rego.v1

required := object.get(object.get(data, ["byoc", "params"], {}), "required_tags", [])

deny contains v if {
	count(required) > 0
	rc := input.resource_changes[_]
	some a in rc.change.actions
	a in {"create", "update"}
	after := rc.change.after
	is_object(after)
	_ = after.tags
	tags := effective_tags(rc)
	missing := [t | t := required[_]; not tags[t]]
	count(missing) > 0
	v := {"rule": "required_tags", "address": rc.address, "msg": sprintf("%s lacks required tags %v", [rc.address, missing])}
}

# tags_all (provider default_tags included) when known, else tags.
effective_tags(rc) := rc.change.after.tags_all if {
	is_object(rc.change.after.tags_all)
} else := object.get(rc.change.after, "tags", {}) if {
	is_object(object.get(rc.change.after, "tags", {}))
} else := {}
