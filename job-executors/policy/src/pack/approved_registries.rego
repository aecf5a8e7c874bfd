# Images come only from approved registries (`approved_registries`: prefixes such as
# "123456789012.dkr.ecr.eu-west-1.amazonaws.com/"). With no list configured the rule
# is inactive.
package byoc.builtin.approved_registries

import rego.v1

approved := object.get(object.get(data, ["byoc", "params"], {}), "approved_registries", [])

pod_spec(m) := m.spec if m.kind == "Pod"

pod_spec(m) := m.spec.template.spec if m.kind in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

pod_spec(m) := m.spec.jobTemplate.spec.template.spec if m.kind == "CronJob"

deny contains v if {
	count(approved) > 0
	m := input.manifests[_]
	spec := pod_spec(m)
	c := array.concat(object.get(spec, "containers", []), object.get(spec, "initContainers", []))[_]
	not from_approved(c.image)
	address := sprintf("%s/%s/%s", [m.kind, object.get(m.metadata, "namespace", "default"), m.metadata.name])
	v := {"rule": "approved_registries", "address": address, "msg": sprintf("container %s in %s uses %s, not from an approved registry", [c.name, address, c.image])}
}

from_approved(image) if {
	some prefix in approved
	startswith(image, prefix)
}
