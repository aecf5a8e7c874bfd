# Builtins policy libraries lean on: walk, json.patch, units.parse_bytes, net.cidr_contains,
# regex.match, glob.match, object.union, array.slice.
package nuon

import rego.v1

# Every string anywhere in the planned values that looks like an access key.
deny contains msg if {
	some rc in input.plan.resource_changes
	walk(rc.change.after, [path, value])
	is_string(value)
	regex.match(`^AKIA[0-9A-Z]{16}$`, value)
	msg := sprintf("%s carries an access key at %v", [rc.address, path])
}

warn contains msg if {
	some rc in input.plan.resource_changes
	some rule in rc.change.after.ingress
	some cidr in rule.cidr_blocks
	not net.cidr_contains("10.0.0.0/8", cidr)
	msg := sprintf("%s admits %s from outside 10.0.0.0/8", [rc.address, cidr])
}

warn contains msg if {
	some rc in input.plan.resource_changes
	glob.match("aws_s3_*", [], rc.type)
	patched := json.patch(object.union({"tags": {}}, rc.change.after), [{"op": "add", "path": "/tags/checked", "value": "yes"}])
	count(patched.tags) > 2
	msg := sprintf("%s has many tags", [rc.address])
}

deny contains msg if {
	some c in input.review.object.spec.template.spec.containers
	units.parse_bytes(c.resources.limits.memory) > units.parse_bytes("1Gi")
	msg := sprintf("%s asks for more than 1Gi", [c.name])
}

pass contains msg if {
	some c in input.review.object.spec.template.spec.containers
	names := array.slice([c.name, "x", "y"], 0, 1)
	msg := sprintf("%s reviewed", names)
}
