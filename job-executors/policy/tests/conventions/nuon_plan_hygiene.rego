# Tags, open ingress, bucket names, encryption: set difference, every, array.concat,
# object.get, startswith/endswith, values unknown until apply.
package nuon

import rego.v1

required_tags := {"owner", "cost-center"}

open_cidrs := {"0.0.0.0/0", "::/0"}

creates_or_updates(rc) if "create" in rc.change.actions

creates_or_updates(rc) if "update" in rc.change.actions

warn contains msg if {
	some rc in input.plan.resource_changes
	creates_or_updates(rc)
	object.get(rc.change.after_unknown, "tags", false) == true
	msg := sprintf("%s: tags are unknown until apply", [rc.address])
}

deny contains msg if {
	some rc in input.plan.resource_changes
	creates_or_updates(rc)
	not object.get(rc.change.after_unknown, "tags", false)
	present := {k | some k, _ in object.get(rc.change.after, "tags", {})}
	missing := required_tags - present
	count(missing) > 0
	msg := sprintf("%s lacks tags %s", [rc.address, concat(", ", sort(missing))])
}

deny contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_security_group"
	some rule in object.get(rc.change.after, "ingress", [])
	cidrs := array.concat(object.get(rule, "cidr_blocks", []), object.get(rule, "ipv6_cidr_blocks", []))
	some cidr in cidrs
	cidr in open_cidrs
	msg := sprintf("%s opens port %d to %s", [rc.address, rule.from_port, cidr])
}

deny contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_s3_bucket"
	name := rc.change.after.bucket
	not startswith(name, "acme-")
	msg := sprintf("%s: bucket %s is not in the acme- namespace", [rc.address, name])
}

warn contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_s3_bucket"
	endswith(rc.change.after.bucket, "-v2")
	msg := sprintf("%s: a second version of a bucket", [rc.address])
}

deny contains "databases must be encrypted" if {
	dbs := [rc | some rc in input.plan.resource_changes; rc.type == "aws_db_instance"; "create" in rc.change.actions]
	count(dbs) > 0
	not all_encrypted(dbs)
}

all_encrypted(dbs) if {
	every db in dbs {
		db.change.after.storage_encrypted == true
	}
}
