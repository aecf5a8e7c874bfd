# Kubernetes objects as admission reviews (nuon convention, one object per evaluation).
package nuon

import rego.v1

kind := input.review.kind.kind

obj := input.review.object

namespace := object.get(obj.metadata, "namespace", "default")

pod_containers := obj.spec.containers if kind == "Pod"

pod_containers := obj.spec.template.spec.containers if kind in {"Deployment", "StatefulSet", "DaemonSet"}

deny contains {"msg": sprintf("%s/%s: container %s is privileged", [kind, obj.metadata.name, c.name]), "container": c.name} if {
	some c in pod_containers
	c.securityContext.privileged == true
}

deny contains msg if {
	kind == "Service"
	obj.spec.type == "LoadBalancer"
	input.review.operation == "CREATE"
	msg := sprintf("a new public Service %s in %s", [obj.metadata.name, namespace])
}

deny contains msg if {
	input.review.operation == "DELETE"
	kind == "PersistentVolumeClaim"
	msg := sprintf("deleting volume claim %s/%s loses data", [namespace, obj.metadata.name])
}

warn contains msg if {
	object.get(input.review.kind, "group", "core") == "core"
	msg := sprintf("%s %s is a core %s object", [input.review.operation, obj.metadata.name, input.review.kind.version])
}
