package nuon

import rego.v1

deny contains count(input.plan.resource_changes) if true
