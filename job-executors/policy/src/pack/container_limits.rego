# Every container (and init container) declares CPU and memory limits.
package byoc.builtin.container_limits

import rego.v1

pod_spec(m) := m.spec if m.kind == "Pod"

pod_spec(m) := m.spec.template.spec if m.kind in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

pod_spec(m) := m.spec.jobTemplate.spec.template.spec if m.kind == "CronJob"

deny contains v if {
	m := input.manifests[_]
	spec := pod_spec(m)
	c := array.concat(object.get(spec, "containers", []), object.get(spec, "initContainers", []))[_]
	some resource in ["cpu", "memory"]
	not c.resources.limits[resource]
	address := sprintf("%s/%s/%s", [m.kind, object.get(m.metadata, "namespace", "default"), m.metadata.name])
	v := {"rule": "container_limits", "address": address, "msg": sprintf("container %s in %s has no %s limit", [c.name, address, resource])}
}
