# Databases are never replaced or deleted by a plan (deprovision may delete: that is
# its purpose; it still may not replace).
package byoc.builtin.database_protection

import rego.v1

database_types := {
	"aws_db_instance", "aws_rds_cluster", "aws_rds_cluster_instance", "aws_docdb_cluster",
	"aws_docdb_cluster_instance", "aws_neptune_cluster", "aws_redshift_cluster",
	"aws_elasticache_replication_group", "aws_elasticache_cluster", "aws_dynamodb_table",
	"aws_opensearch_domain", "aws_elasticsearch_domain", "aws_memorydb_cluster",
}

deny contains v if {
	rc := input.resource_changes[_]
	database_types[rc.type]
	actions := rc.change.actions
	"delete" in actions
	"create" in actions
	v := {"rule": "database_protection", "address": rc.address, "msg": sprintf("%s (%s) would be replaced, destroying its data", [rc.address, rc.type])}
}

deny contains v if {
	rc := input.resource_changes[_]
	database_types[rc.type]
	rc.change.actions == ["delete"]
	input.byoc.phase != "deprovision"
	v := {"rule": "database_protection", "address": rc.address, "msg": sprintf("%s (%s) would be deleted outside deprovision", [rc.address, rc.type])}
}
