# conftest also queries rules whose names carry a suffix: deny_*, violation_*, warn_*.
package main

import rego.v1

deny_open_ssh contains msg if {
	some rc in input.resource_changes
	is_object(rc.change.after)
	some rule in object.get(rc.change.after, "ingress", [])
	rule.from_port == 22
	msg := sprintf("%s opens ssh", [rc.address])
}

warn_unnamed_bucket contains msg if {
	some rc in input.resource_changes
	rc.type == "aws_s3_bucket"
	endswith(rc.change.after.bucket, "-v2")
	msg := sprintf("%s: a versioned bucket name", [rc.address])
}
