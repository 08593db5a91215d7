"""The Pod of a Kubernetes manifest's Deployment, as container-engine options.

For scripts/image-check.sh, which runs the containers of examples/kubernetes/ the way a
kubelet would, without a cluster: one container's security context, environment and volumes
become `docker run`/`podman run` options, its probes and preStop hook become commands to run
in it with `exec`.

Usage: image-check-pod.py MANIFEST WORK_DIR VOLUME_PREFIX QUERY [CONTAINER]

QUERY (output on stdout, one item a line):
  options CONTAINER   run options: --user, --read-only, --cap-drop, --security-opt, -e, -v and
                      --entrypoint (a JSON array, from `command`). A configMap volume is written
                      out under WORK_DIR and mounted; an emptyDir is a named volume
                      VOLUME_PREFIX-<volume name>, shared by the Pod's containers as in the Pod.
                      A valueFrom environment variable (a Secret) gets a stand-in value.
  args CONTAINER      the container's `args`
  probes CONTAINER    its readiness and liveness probes, each a JSON array: the command to
                      `exec` in the container (httpGet becomes curl on 127.0.0.1, as the Pod's
                      containers share one network namespace)
  pre-stop CONTAINER  its preStop exec command, a JSON array (nothing if none)
  grace               terminationGracePeriodSeconds (30 if unset, as in Kubernetes)

Only what the example uses is translated; anything else is refused by name, so the check
cannot pass while ignoring part of the manifest.
"""

import json
import os
import sys

import yaml

SECRET_STAND_IN = "image-check-secret"


def refuse(what):
    sys.exit(f"image-check-pod.py: {what} is not translated (extend scripts/image-check-pod.py)")


def main():
    manifest, work, volume_prefix, query, *rest = sys.argv[1:]
    docs = [d for d in yaml.safe_load_all(open(manifest)) if d]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    if len(deployments) != 1:
        refuse(f"a manifest with {len(deployments)} Deployments")
    pod = deployments[0]["spec"]["template"]["spec"]
    if query == "grace":
        print(pod.get("terminationGracePeriodSeconds", 30))
        return
    (name,) = rest
    container = next((c for c in pod["containers"] if c["name"] == name), None)
    if container is None:
        sys.exit(f"image-check-pod.py: no container {name!r} in the Deployment")
    if query == "options":
        print("\n".join(options(docs, pod, container, work, volume_prefix)))
    elif query == "args":
        print("\n".join(container.get("args", [])))
    elif query == "probes":
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        for kind in ("readinessProbe", "livenessProbe"):
            if kind in container:
                print(json.dumps(probe_command(container[kind], ports, kind)))
    elif query == "pre-stop":
        pre_stop = container.get("lifecycle", {}).get("preStop")
        if pre_stop:
            if "exec" not in pre_stop:
                refuse("a preStop hook other than exec")
            print(json.dumps(pre_stop["exec"]["command"]))
    else:
        sys.exit(f"image-check-pod.py: unknown query {query!r}")


def options(docs, pod, container, work, volume_prefix):
    out = []
    pod_context = pod.get("securityContext", {})
    context = container.get("securityContext", {})
    user = context.get("runAsUser", pod_context.get("runAsUser"))
    group = context.get("runAsGroup", pod_context.get("runAsGroup"))
    if user is not None:
        out += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if context.get("readOnlyRootFilesystem"):
        out.append("--read-only")
    for capability in context.get("capabilities", {}).get("drop", []):
        out += ["--cap-drop", capability]
    if context.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    for variable in container.get("env", []):
        value = variable["value"] if "value" in variable else SECRET_STAND_IN
        out += ["-e", f"{variable['name']}={value}"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        suffix = ":ro" if mount.get("readOnly") else ""
        if "configMap" in volume:
            source = os.path.join(work, f"configmap-{mount['name']}")
            config_map = next(
                d
                for d in docs
                if d["kind"] == "ConfigMap"
                and d["metadata"]["name"] == volume["configMap"]["name"]
            )
            os.makedirs(source, exist_ok=True)
            for key, text in config_map.get("data", {}).items():
                with open(os.path.join(source, key), "w") as file:
                    file.write(text)
        elif "emptyDir" in volume:
            source = f"{volume_prefix}-{mount['name']}"
        else:
            refuse(f"volume {mount['name']!r} (neither configMap nor emptyDir)")
        out += ["-v", f"{source}:{mount['mountPath']}{suffix}"]
    if "command" in container:
        out += ["--entrypoint", json.dumps(container["command"])]
    return out


def probe_command(probe, ports, kind):
    if "exec" in probe:
        return probe["exec"]["command"]
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        port = ports.get(port, port)
        url = f"http://127.0.0.1:{port}{probe['httpGet'].get('path', '/')}"
        return ["curl", "-fsS", "--max-time", "2", "-o", "/dev/null", url]
    refuse(f"a {kind} other than exec and httpGet")


if __name__ == "__main__":
    main()
