# Storage is encrypted at rest: EBS volumes, RDS instances and clusters, S3 buckets (an
# inline or separate server-side encryption configuration). A value unknown until
# apply counts as unencrypted.
package byoc.builtin.storage_encryption

import rego.v1

# Indexes, not whole resources (a set of large objects compares them deeply).
creating contains i if {
	some i, rc in input.resource_changes
	flag[rc.type]
	some a in rc.change.actions
	a in {"create", "update"}
}

flag := {"aws_ebs_volume": "encrypted", "aws_db_instance": "storage_encrypted", "aws_rds_cluster": "storage_encrypted", "aws_docdb_cluster": "storage_encrypted", "aws_neptune_cluster": "storage_encrypted", "aws_efs_file_system": "encrypted"}

deny contains v if {
	some i in creating
	rc := input.resource_changes[i]
	key := flag[rc.type]
	not object.get(rc.change.after, key, false) == true
	not object.get(object.get(rc.change, "after_unknown", {}), key, false) == true
	v := {"rule": "storage_encryption", "address": rc.address, "msg": sprintf("%s is not encrypted at rest (%s is not true)", [rc.address, key])}
}

deny contains v if {
	some i in creating
	rc := input.resource_changes[i]
	key := flag[rc.type]
	object.get(object.get(rc.change, "after_unknown", {}), key, false) == true
	v := {"rule": "storage_encryption", "address": rc.address, "msg": sprintf("%s: %s is unknown until apply", [rc.address, key])}
}

deny contains v if {
	rc := input.resource_changes[_]
	rc.type == "aws_s3_bucket"
	"create" in rc.change.actions
	count(object.get(rc.change.after, "server_side_encryption_configuration", [])) == 0
	not encryption_configured(rc)
	v := {"rule": "storage_encryption", "address": rc.address, "msg": sprintf("%s has no server-side encryption configuration in this plan", [rc.address])}
}

# A separate aws_s3_bucket_server_side_encryption_configuration whose `bucket` refers
# to this bucket (the plan's configuration section keeps the references).
encryption_configured(bucket) if {
	r := config_resources[_]
	r.type == "aws_s3_bucket_server_side_encryption_configuration"
	ref := r.expressions.bucket.references[_]
	local := trim_prefix(bucket.address, sprintf("%s.", [object.get(bucket, "module_address", "")]))
	ref in {local, sprintf("%s.id", [local]), sprintf("%s.bucket", [local])}
}

config_resources contains r if {
	r := input.configuration.root_module.resources[_]
}

config_resources contains r if {
	r := input.configuration.root_module.module_calls[_].module.resources[_]
}
