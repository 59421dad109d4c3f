"""infra/ parses and points at the real entry point: the image installs this package on Ray's image, the RayJob runs a
job file that `hsx run` accepts on a cluster whose head does no work, the `ray up` file matches (no cluster needed)."""

from __future__ import annotations

import os
import re
import shlex

import pytest
import ray
import yaml

from cli.args import config_from_args
from cli.main import build_parser

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INFRA = os.path.join(ROOT, "infra")


def _load_all(name):
    with open(os.path.join(INFRA, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


@pytest.fixture(scope="module")
def rayjob():
    docs = _load_all("kuberay/rayjob.yaml")
    return {d["kind"]: d for d in docs}


def test_hsx_entry_point_is_the_cli_main():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["scripts"]["hsx"] == "cli.main:main"
    from cli.main import main

    assert callable(main)


def test_dockerfile_builds_this_package_on_rays_gpu_image_of_the_tested_version():
    text = open(os.path.join(INFRA, "Dockerfile")).read()
    version = re.search(r"^ARG RAY_VERSION=(\S+)", text, re.M).group(1)
    assert version == ray.__version__
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{PYTHON\}-gpu$", text, re.M)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
    for package in sorted({p.split(".")[0] for p in packages}):  # a subpackage travels with its top-level folder
        assert re.search(rf"^COPY .*\b{package} \./{package}$", text, re.M), f"{package} is not copied"
        assert os.path.isdir(os.path.join(ROOT, package))
    assert 'pip install --no-cache-dir ".[s3,gcs]"' in text and "hsx --help" in text


def test_rayjob_runs_hsx_on_a_job_file_the_cli_accepts(rayjob, tmp_path):
    job = rayjob["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["hsx", "run"]
    args = build_parser().parse_args(argv[1:])
    config_path = args.config
    # the job file is the ConfigMap key mounted where the entrypoint reads it, on the head (where the driver runs)
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    configmap = rayjob["ConfigMap"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    key = os.path.relpath(config_path, mount["mountPath"])
    local = tmp_path / key
    local.write_text(configmap["data"][key])
    args.config = str(local)
    config = config_from_args(args)
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus_per_pod = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert config.workers * config.gpus_per_worker <= workers["replicas"] * gpus_per_pod
    assert config.gpus_per_worker >= 1


def test_rayjob_head_does_no_work_and_gpu_workers_get_shared_memory(rayjob):
    spec = rayjob["RayJob"]["spec"]["rayClusterSpec"]
    assert spec["rayVersion"] == ray.__version__
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    pod = spec["workerGroupSpecs"][0]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"]
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    images = {c["image"] for c in [spec["headGroupSpec"]["template"]["spec"]["containers"][0], container]}
    assert len(images) == 1


def test_ray_up_cluster_uses_the_image_and_keeps_work_off_the_head(rayjob):
    (cluster,) = _load_all("ray-cluster.yaml")
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"]["CPU"] == 0
    assert any("--num-cpus=0" in c for c in cluster["head_start_ray_commands"])
    workers = [t for name, t in cluster["available_node_types"].items() if name != cluster["head_node_type"]]
    assert workers and all(t["max_workers"] >= 1 for t in workers)
    image = rayjob["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert cluster["docker"]["image"] == image
    assert any("--shm-size" in o for o in cluster["docker"]["run_options"])


def test_infra_readme_commands_use_real_subcommands_and_flags():
    text = open(os.path.join(INFRA, "README.md")).read()
    parser = build_parser()
    commands = re.findall(r"^hsx (submit|status|run) (.+?)(?<!\\)$", text.replace("\\\n  ", " "), re.M)
    assert commands
    for command, rest in commands:
        argv = [command, *shlex.split(rest.replace("...same flags...", ""))]
        if command == "status" or "--model" in argv:
            parser.parse_args(argv)  # SystemExit(2) on an unknown flag
