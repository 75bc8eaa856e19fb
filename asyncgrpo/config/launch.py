"""The ``launch`` section: how ``asyncgrpo launch`` lays a run out over machines.

Only the launcher reads it; the jobs it starts get everything else of the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from asyncgrpo.errors import ConfigError

_TIMEOUT = re.compile(r"[0-9]+(\.[0-9]+)?[smhd]?")
#: SkyPilot's managed-job recovery strategies (``job_recovery.strategy``).
SKY_RECOVERY = ("EAGER_NEXT_REGION", "FAILOVER")
#: The trainer job's config (YAML, secrets emptied) travels in this environment variable.
CONFIG_ENV = "ASYNCGRPO_CONFIG"
#: The launch backends by the name ``asyncgrpo launch --backend`` takes: the class that
#: implements each (the :class:`~asyncgrpo.launch.jobs.Backend` interface), as ``module:Class``,
#: imported only by a launch that uses it. A new backend is a module in ``asyncgrpo/launch/``
#: and an entry here; one whose jobs run on other machines builds on
#: :class:`~asyncgrpo.launch.remote.RemoteBackend` (specs, secrets, refusals).
LAUNCH_BACKENDS = {
    "hf-jobs": "asyncgrpo.launch.hf_jobs:HfJobsBackend",
    "ray": "asyncgrpo.launch.ray_jobs:RayBackend",
    "skypilot": "asyncgrpo.launch.skypilot:SkyPilotBackend",
    "local": "asyncgrpo.launch.local:LocalBackend",
}
#: Hugging Face Jobs' exposed-port URL, used when a job does not report its own.
JOBS_URL_TEMPLATE = "https://{job_id}--{port}.hf.jobs"


@dataclass(kw_only=True)
class LaunchConfig:
    """N inference jobs (one vLLM server each) and one trainer job (proxy, rollouts, trainer)."""

    replicas: int = 2
    """Inference jobs, one vLLM server each."""
    image: str = "vllm/vllm-openai:v0.32.0"
    """Docker image of the inference jobs (and of the trainer unless trainer_image is set); it
    must have Python, pip and the vLLM asyncgrpo's replica plugin is written against (0.32): a
    replica on another vLLM fails at start naming it, before the trainer starts."""
    trainer_image: str | None = None
    """Docker image of the trainer job; None: image."""
    replica_flavor: str = "a10g-large"
    """Hugging Face Jobs hardware of each inference job (list_jobs_hardware)."""
    trainer_flavor: str = "a100-large"
    """Hugging Face Jobs hardware of the trainer job."""
    namespace: str | None = None
    """User or organisation the jobs run (and bill) under; None: the token's."""
    timeout: str = "8h"
    """Longest a job may run before Hugging Face stops it: seconds, or a number with s, m, h or
    d. A bound on the bill if the launcher dies."""
    port: int = 8000
    """Port each vLLM server listens on (exposed through the Jobs gateway); with
    replica_restarts, the trainer job's proxy's too, where the launcher adds replacements."""
    replica_install: str | None = "asyncgrpo[s3,hf]"
    """pip requirement installed in each inference job before it starts (a name,
    'asyncgrpo[s3,hf] @ git+https://...', or a wheel URL); None: the image has it."""
    trainer_install: str | None = "asyncgrpo[train,s3,hf]"
    """pip requirement installed in the trainer job; None: the image has it."""
    jobs_url_template: str = JOBS_URL_TEMPLATE
    """URL of a job's exposed port, from {job_id} and {port}; used when the Jobs API does not
    report the job's URL itself."""
    health_timeout_s: float = 1800.0
    """Seconds an inference job may take to answer /health (image pull, model download and
    load)."""
    poll_s: float = 5.0
    """Seconds between status checks of the jobs."""
    replica_restarts: int = 3
    """Inference jobs the launch may start in place of ones that end during the run (spot
    preemption, a crashed host); training continues on the others meanwhile. 0: a replica job
    that ends stops the launch, naming it."""
    replica_restart_backoff_s: float = 30.0
    """Seconds before the first replacement starts; doubled for each further one, up to 10
    minutes."""
    log_tail_lines: int = 40
    """Log lines quoted when a job fails."""
    local_transport: Literal["dir", "s3"] = "dir"
    """--backend local without transport_url: 'dir', a directory no role works in (survives a
    relaunch, so a run resumes), or 's3', an S3 protocol server (moto) on loopback, started for
    the launch."""
    sweep: list[str] = field(default_factory=list)
    """A sweep: KEY=V1,V2,... (repeat for every combination of several keys), e.g.
    trainer.learning_rate=1e-5,3e-5,1e-4. One trainer per point, run <run_name>-<i>, all on
    one fleet (the replicas behind one proxy, sized for every point)."""
    proxy_flavor: str = "cpu-upgrade"
    """Hugging Face Jobs hardware of a sweep's proxy job."""
    local_hide_trainer: bool = False
    """--backend local: run each replica in a private mount namespace where the trainer's
    directory is an empty tmpfs, so a replica provably uses nothing of the trainer's disk
    (Linux; needs root and `unshare`)."""

    infra: str | None = None
    """--backend skypilot: where every job runs, as SkyPilot names it: a cloud (aws), a region
    (gcp/us-central1), Kubernetes (k8s, k8s/CONTEXT), Slurm (slurm/CLUSTER); None: the cheapest
    of the enabled infra (`sky check`)."""
    replica_accelerators: str | None = "A10G:1"
    """--backend skypilot: accelerators of each inference job (SkyPilot's NAME:COUNT); None: a
    CPU machine."""
    trainer_accelerators: str | None = "A100:1"
    """--backend skypilot: accelerators of the trainer job."""
    use_spot: bool = False
    """--backend skypilot: inference jobs on spot (preemptible) machines; SkyPilot relaunches a
    preempted one and the launcher adds it back to the proxy at its new address."""
    trainer_use_spot: bool = False
    """--backend skypilot: the trainer job on a spot machine too (it resumes from its last
    checkpoint in the transport when SkyPilot relaunches it)."""
    recovery: str = "EAGER_NEXT_REGION"
    """--backend skypilot: how SkyPilot relaunches a preempted job: EAGER_NEXT_REGION (another
    region first) or FAILOVER (the same region first)."""
    max_restarts_on_errors: int = 0
    """--backend skypilot: times SkyPilot reruns a job whose command failed (not preempted);
    each rerun gets launch.timeout again."""

    ray_address: str | None = None
    """--backend ray: the Ray cluster to connect to (ray://HOST:10001, HOST:6379, or auto: the
    one this machine belongs to); None: $RAY_ADDRESS, else auto."""
    replica_num_gpus: float = 1.0
    """--backend ray: GPUs each inference actor reserves (Ray sets CUDA_VISIBLE_DEVICES for its
    vLLM server); 0 on CPU nodes."""
    trainer_num_gpus: float = 1.0
    """--backend ray: GPUs the trainer actor reserves."""
    replica_num_cpus: float = 1.0
    """--backend ray: CPUs each inference actor reserves."""
    trainer_num_cpus: float = 1.0
    """--backend ray: CPUs the trainer actor reserves."""
    replica_resources: dict[str, float] = field(default_factory=dict)
    """--backend ray: custom Ray resources each inference actor needs, e.g. {inference: 1}: it
    then runs only on nodes started with that resource (ray start --resources)."""
    trainer_resources: dict[str, float] = field(default_factory=dict)
    """--backend ray: custom Ray resources the trainer actor needs, e.g. {trainer: 1}."""
    replica_accelerator_type: str | None = None
    """--backend ray: the accelerator each inference actor needs (Ray's accelerator_type, e.g.
    A10G, H100); None: any."""
    trainer_accelerator_type: str | None = None
    """--backend ray: the accelerator the trainer actor needs; None: any."""

    def __post_init__(self) -> None:
        for name in (
            "replica_num_gpus",
            "trainer_num_gpus",
            "replica_num_cpus",
            "trainer_num_cpus",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"launch.{name}={getattr(self, name)}: must be >= 0")
        for name in ("replica_resources", "trainer_resources"):
            for key, amount in getattr(self, name).items():
                if not amount > 0:
                    raise ConfigError(f"launch.{name}: {key}={amount}: each amount must be > 0")
        if self.replicas < 1:
            raise ConfigError(f"launch.replicas={self.replicas}: set it to 1 or more")
        if not _TIMEOUT.fullmatch(self.timeout):
            raise ConfigError(
                f"launch.timeout={self.timeout!r}: write seconds or a number with s, m, h or d, "
                "e.g. 8h"
            )
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"launch.port={self.port}: use a TCP port, e.g. 8000")
        if "{job_id}" not in self.jobs_url_template:
            raise ConfigError(
                f"launch.jobs_url_template={self.jobs_url_template!r}: it must contain {{job_id}}"
                f" (and usually {{port}}), e.g. {JOBS_URL_TEMPLATE}"
            )
        if not self.health_timeout_s > 0:
            raise ConfigError(f"launch.health_timeout_s={self.health_timeout_s}: must be > 0")
        if not self.poll_s > 0:
            raise ConfigError(f"launch.poll_s={self.poll_s}: must be > 0")
        if self.replica_restarts < 0:
            raise ConfigError(
                f"launch.replica_restarts={self.replica_restarts}: set it to 0 (no replacement) "
                "or more"
            )
        if self.replica_restart_backoff_s < 0:
            raise ConfigError(
                f"launch.replica_restart_backoff_s={self.replica_restart_backoff_s}: must be >= 0"
            )
        if self.log_tail_lines < 1:
            raise ConfigError(f"launch.log_tail_lines={self.log_tail_lines}: set it to 1+")
        if self.recovery.upper() not in SKY_RECOVERY:
            raise ConfigError(f"launch.recovery={self.recovery!r}: use {' or '.join(SKY_RECOVERY)}")
        self.recovery = self.recovery.upper()
        if self.max_restarts_on_errors < 0:
            raise ConfigError(
                f"launch.max_restarts_on_errors={self.max_restarts_on_errors}: must be >= 0"
            )
        if self.local_transport not in ("dir", "s3"):
            raise ConfigError(f"launch.local_transport={self.local_transport!r}: use 'dir' or 's3'")

    @property
    def timeout_s(self) -> int:
        """``timeout`` in seconds (the unit rules of ``huggingface_hub.run_job``)."""
        factor = {"s": 1, "m": 60, "h": 3600, "d": 86400}
        unit = self.timeout[-1]
        if unit in factor:
            return int(float(self.timeout[:-1]) * factor[unit])
        return int(float(self.timeout))
