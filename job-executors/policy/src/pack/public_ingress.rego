# No new public ingress: security groups open to 0.0.0.0/0 or ::/0 (a CIDR unknown
# until apply counts as open), Kubernetes Ingress objects, internet-facing LoadBalancer
# services.
package byoc.builtin.public_ingress

import rego.v1

open_cidrs := {"0.0.0.0/0", "::/0"}

# Indexes, not whole resources: a set of large objects costs a deep comparison per
# member.
changing contains i if {
	some i, rc in input.resource_changes
	sg_types[rc.type]
	some a in rc.change.actions
	a in {"create", "update"}
}

sg_types := {"aws_security_group", "aws_security_group_rule", "aws_vpc_security_group_ingress_rule"}

violation(rc, what) := {"rule": "public_ingress", "address": rc.address, "msg": sprintf("%s %s", [rc.address, what])}

# Inline ingress blocks of aws_security_group.
deny contains violation(rc, sprintf("allows ingress from %s", [cidr])) if {
	some i in changing
	rc := input.resource_changes[i]
	rc.type == "aws_security_group"
	rule := rc.change.after.ingress[_]
	cidr := array.concat(object.get(rule, "cidr_blocks", []), object.get(rule, "ipv6_cidr_blocks", []))[_]
	open_cidrs[cidr]
}

deny contains violation(rc, "has ingress rules unknown until apply") if {
	some i in changing
	rc := input.resource_changes[i]
	rc.type == "aws_security_group"
	unknown_ingress(object.get(rc.change, "after_unknown", {}))
}

unknown_ingress(u) if u.ingress == true

unknown_ingress(u) if {
	block := u.ingress[_]
	some key in ["cidr_blocks", "ipv6_cidr_blocks"]
	unknown_list(object.get(block, key, false))
}

unknown_list(x) if x == true

unknown_list(x) if {
	is_array(x)
	x[_] == true
}

deny contains violation(rc, sprintf("allows ingress from %s", [cidr])) if {
	some i in changing
	rc := input.resource_changes[i]
	rc.type == "aws_security_group_rule"
	rc.change.after.type == "ingress"
	cidr := array.concat(object.get(rc.change.after, "cidr_blocks", []), object.get(rc.change.after, "ipv6_cidr_blocks", []))[_]
	open_cidrs[cidr]
}

deny contains violation(rc, "allows ingress from CIDRs unknown until apply") if {
	some i in changing
	rc := input.resource_changes[i]
	rc.type == "aws_security_group_rule"
	rc.change.after.type == "ingress"
	some key in ["cidr_blocks", "ipv6_cidr_blocks"]
	unknown_list(object.get(object.get(rc.change, "after_unknown", {}), key, false))
}

deny contains violation(rc, sprintf("allows ingress from %s", [cidr])) if {
	some i in changing
	rc := input.resource_changes[i]
	rc.type == "aws_vpc_security_group_ingress_rule"
	some key in ["cidr_ipv4", "cidr_ipv6"]
	cidr := object.get(rc.change.after, key, null)
	open_cidrs[cidr]
}

deny contains violation(rc, "allows ingress from a CIDR unknown until apply") if {
	some i in changing
	rc := input.resource_changes[i]
	rc.type == "aws_vpc_security_group_ingress_rule"
	some key in ["cidr_ipv4", "cidr_ipv6"]
	object.get(object.get(rc.change, "after_unknown", {}), key, false) == true
}

# Kubernetes.
deny contains v if {
	m := input.manifests[_]
	m.kind == "Ingress"
	v := {"rule": "public_ingress", "address": manifest_address(m), "msg": sprintf("%s exposes the cluster through an Ingress", [manifest_address(m)])}
}

deny contains v if {
	m := input.manifests[_]
	m.kind == "Service"
	m.spec.type == "LoadBalancer"
	not internal_lb(m)
	v := {"rule": "public_ingress", "address": manifest_address(m), "msg": sprintf("%s is an internet-facing LoadBalancer", [manifest_address(m)])}
}

internal_lb(m) if m.metadata.annotations["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"

internal_lb(m) if m.metadata.annotations["service.beta.kubernetes.io/aws-load-balancer-scheme"] == "internal"

manifest_address(m) := sprintf("%s/%s/%s", [m.kind, object.get(m.metadata, "namespace", "default"), m.metadata.name])
