package nuon

import rego.v1

region := "eu" if {
	some rc in input.plan.resource_changes
	rc.type == "aws_eip"
}

region := "us" if {
	some rc in input.plan.resource_changes
	rc.type == "aws_s3_bucket"
}

deny contains msg if {
	region == "us"
	msg := "not in the us"
}
