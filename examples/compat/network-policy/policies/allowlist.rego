# Asks a service over the network which resource types are allowed.
package nuon

import rego.v1

allowed := http.send({"method": "get", "url": "https://policy.example.com/allowed.json"}).body

deny contains msg if {
	some rc in input.plan.resource_changes
	not allowed[rc.type]
	msg := sprintf("%s is not on the allow-list", [rc.address])
}
