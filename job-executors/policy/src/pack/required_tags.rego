# Taggable resources carry the required tags (`required_tags`). With no list
# configured the rule is inactive.
package byoc.builtin.required_tags

import rego.v1

required := object.get(object.get(data, ["byoc", "params"], {}), "required_tags", [])

deny contains v if {
	count(required) > 0
	some rc in input.resource_changes
	after := rc.change.after
	is_object(after)
	_ = after.tags
	some a in rc.change.actions
	a in {"create", "update"}
	# tags_all (provider default_tags included) when known, plus tags.
	tags := object.union(tag_map(after.tags), tag_map(object.get(after, "tags_all", null)))
	missing := [t | some t in required; not tags[t]]
	count(missing) > 0
	v := {"rule": "required_tags", "address": rc.address, "msg": sprintf("%s lacks required tags %v", [rc.address, missing])}
}

tag_map(x) := x if is_object(x)

tag_map(x) := {} if not is_object(x)
