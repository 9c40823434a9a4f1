"""Engine-wide settings, fixed at start-up (per-request knobs are `DecodeParams`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.dtype_names import DTYPE_ALIASES

# weight-only quantization of the decoder layers' linear layers (engine.quantization)
QUANTIZATION_MODES = ("none", "int8", "int4", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # local checkpoint directory
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 8  # rows decoded together in one step
    use_flash_attn: Optional[bool] = None  # None: when installed and usable
    max_model_len: Optional[int] = None  # prompt + canvas; None: the model's context
    # run the cached steps as CUDA graphs, one per batch bucket and shape (engine.static_forward); CUDA only.
    # None: on for CUDA at tensor_parallel_size 1 (vLLM captures graphs unless --enforce-eager; the H200
    # check measured the same tokens, docs/performance.md), off elsewhere
    cuda_graphs: Optional[bool] = None
    # compile the cached steps' static forwards with torch.compile(fullgraph=True), one per shape, where
    # they do not run as CUDA graphs (engine.static_forward; the first step of each shape compiles it)
    torch_compile: bool = False
    # the most top alternatives a request may ask for per token (vLLM's --max-logprobs)
    max_logprobs: int = 20
    # the most tokens one likelihood-scoring request may feed the model: (n - 1) x samples x n for a
    # prompt of n tokens (engine.scoring); beyond it the request is refused. The default is what the
    # bundled model scores well within the server's 60 s stall timeout on a 2-core CPU (~13 k tokens/s
    # on one thread, `bench/score_variance.py chunks`): a request at the limit ends in about 40 s
    max_score_tokens: int = 1 << 19
    # the most tokens one scoring forward feeds the model (at least one row of the prompt): the server
    # runs a scoring request as such chunks between decode steps, so a step waits on one at most.
    # About the tokens a full batch's step feeds; smaller chunks cost no throughput (`score_variance.py chunks`)
    score_chunk_tokens: int = 1024
    # torch's intra-op CPU threads; None: the CPUs this process may use (engine.cpus: affinity and
    # cgroup quota, at most OMP_NUM_THREADS), not torch's default of every core of the machine
    threads: Optional[int] = None
    # weight-only quantization of the decoder layers' linear layers, applied while loading; the head
    # too when quantize_head (engine.quantization, docs/operations.md)
    quantization: str = "none"
    quantize_head: bool = False
    # tensor parallelism (vLLM's --tensor-parallel-size): the model split across this many processes,
    # one a GPU on CUDA (rank r on cuda:r), all on this host's CPUs otherwise (engine.executor)
    tensor_parallel_size: int = 1
    # seconds a rank waits on another (a collective, a worker's answer to rank 0's heartbeat) before
    # the group is declared failed: above the slowest step, so only a hang or a death trips it
    distributed_timeout: float = 120.0
    # exact prefix caching across requests (vLLM's --enable-prefix-caching; engine.prefix_cache): None
    # is on where the model's decoding mode allows it (block and uniform-noise diffusion) and off elsewhere; True where
    # it does not (masked diffusion: a prompt's keys depend on what follows it) is refused at start-up
    enable_prefix_caching: Optional[bool] = None
    # the prefix cache's memory on the device, in GiB (per rank under tensor parallelism); None: a
    # tenth of the device's memory. Blocks take memory only once cached
    prefix_cache_gb: Optional[float] = None

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {self.max_batch!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if isinstance(self.max_score_tokens, bool) or not isinstance(self.max_score_tokens, int) \
                or self.max_score_tokens < 1:
            raise ValueError(f"max_score_tokens must be a positive integer, got {self.max_score_tokens!r}")
        if isinstance(self.score_chunk_tokens, bool) or not isinstance(self.score_chunk_tokens, int) \
                or self.score_chunk_tokens < 1:
            raise ValueError(f"score_chunk_tokens must be a positive integer, got {self.score_chunk_tokens!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if self.cuda_graphs and not self.device.startswith("cuda"):  # asked for, not defaulted
            raise ValueError(f"cuda_graphs needs a CUDA device, got device {self.device!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {self.quantization!r}")
        if self.quantize_head and self.quantization == "none":
            raise ValueError("quantize_head needs a quantization mode other than none")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.cuda_graphs:
            raise ValueError("cuda_graphs is not available with tensor_parallel_size > 1 (the step's collectives "
                             "are not captured; docs/operations.md, 'Several GPUs')")
        if self.tensor_parallel_size > 1 and self.torch_compile:
            raise ValueError("torch_compile is not available with tensor_parallel_size > 1 (the step's collectives "
                             "are not compiled)")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout!r}")
        if self.prefix_cache_gb is not None and (isinstance(self.prefix_cache_gb, bool)
                                                 or not isinstance(self.prefix_cache_gb, (int, float))
                                                 or not self.prefix_cache_gb > 0):
            raise ValueError(f"prefix_cache_gb must be a positive number, got {self.prefix_cache_gb!r}")
        if self.dtype.lower() not in DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {self.dtype!r}")

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether the dual-cache step runs as CUDA graphs: `cuda_graphs` when set, else its default."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return self.device.startswith("cuda") and self.tensor_parallel_size == 1

    @property
    def static_forwards(self) -> Optional[str]:
        """How the cached steps' static forwards run (engine.static_forward.HOW), None: not at all."""
        if self.uses_cuda_graphs:
            return "graph"
        return "compile" if self.torch_compile else None
