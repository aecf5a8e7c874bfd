package acme.guardrails

import rego.v1

deny contains "always" if true
