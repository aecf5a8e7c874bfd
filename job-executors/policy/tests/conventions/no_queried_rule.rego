package nuon

import rego.v1

allow if count(input.plan.resource_changes) < 100

violations contains "not a rule the nuon convention queries" if true
