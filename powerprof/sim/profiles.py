"""Simulated GPU profiles: the physical constants of each card the simulator can play."""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1024**3


@dataclass(frozen=True)
class WorkloadDefaults:
    """How the simulated inference server loads this card (one model, one server build)."""

    decode_tok_s: float  # single-stream decode speed at full SM clock, no cap
    prefill_tok_s: float  # prompt tokens per second at full SM clock
    decode_compute_share: float  # share of a decode step that scales with SM clock, at f_max
    speculative: bool = False
    draft_n_max: int = 0
    draft_acceptance: float = 0.0  # acceptance of the first draft token (see sim/knobs.py)
    draft_acceptance_decay: float = 0.0  # each later draft position is accepted this much less often
    draft_cost: float = 0.0  # extra step time per draft token, relative to a plain step
    weights_bytes: int = 0  # weights and compute buffers: memory the server needs whatever its knobs
    kv_bytes_per_token: int = 0  # KV cache per context token (all slots share --ctx-size)
    state_bytes_per_seq: int = 0  # recurrent-state snapshot per sequence; (draft + 1) of them per slot
    ctx_tokens_double: float = 0.0  # context at which a sequence's KV reads equal the weight reads (0: no effect)
    batch_compute_growth: float = 0.6  # extra compute share per additional concurrent stream
    cpu_idle_w: float = 18.0  # CPU package power with the server idle
    cpu_busy_w: float = 25.0  # CPU package power above idle while the server works


@dataclass(frozen=True)
class GpuProfile:
    """A card. Powers in W, clocks in MHz, voltages in V."""

    key: str
    name: str
    architecture: str
    memory_total_bytes: int
    min_limit_w: float
    max_limit_w: float
    default_limit_w: float
    idle_power_w: float  # at idle clock with nothing running
    static_power_w: float  # board, leakage and fans while a kernel runs, independent of SM clock
    mem_power_w: float  # memory subsystem at full memory activity (memory clock is fixed)
    dyn_power_w: float  # SM dynamic power at f_max, V_max and full SM activity
    sm_base_activity: float  # share of SM switching that goes on even while stalled on memory
    sm_clock_min_mhz: int
    sm_clock_max_mhz: int
    sm_clock_idle_mhz: int
    sm_clock_step_mhz: int
    mem_clock_mhz: int
    volt_min_v: float
    volt_max_v: float
    workload: WorkloadDefaults
    has_energy_counter: bool = True
    has_instant_power: bool = True
    # What nvmlDeviceGetPowerUsage averages over (0: instant power). NVIDIA's NVML reference: a 1 s trailing
    # average on Ampere except GA100 (A100, A800, A30) and newer; instant on GA100 and older architectures.
    # Field 185 (NVML_FI_DEV_POWER_AVERAGE) exists only where it averages.
    power_avg_window_s: float = 1.0
    energy_counter_update_s: float = 0.02  # the driver refreshes the counter every 10-100 ms
    # The driver refreshes instant power (field 186; nvmlDeviceGetPowerUsage where it does not average) this often;
    # a read shows the power as of the last refresh. A real H200's changed every ~100 ms (docs/hardware.md). 0: the
    # simulated reading is the power at the read (the profiles no real card of theirs was measured for).
    instant_power_update_s: float = 0.0
    # What a read of the energy counter costs the caller: (median s, p99 s) of CPU, spent inside the
    # driver. Zero where nothing was measured; the H200's is docs/hardware.md's real figure.
    energy_counter_call_s: tuple[float, float] = (0.0, 0.0)
    ambient_c: float = 30.0
    thermal_resistance_c_per_w: float = 0.15
    thermal_time_constant_s: float = 40.0
    driver_version: str = "580.95.05"
    mig_capable: bool = False  # A100/H100/H200 answer nvmlDeviceGetMigMode (disabled: [0, 0]); GeForce cards say NOT_SUPPORTED
    extra: dict = field(default_factory=dict)

    @property
    def sm_clocks_mhz(self) -> tuple[int, ...]:
        """The supported SM clocks, ascending: every `sm_clock_step_mhz` down from the maximum (a card lists its top
        clock first; where the range is no whole number of steps, the lowest is a little above `sm_clock_min_mhz`).
        What NVML lists and what the simulated GPU runs at, stated once."""
        return tuple(range(self.sm_clock_max_mhz, self.sm_clock_min_mhz - 1, -self.sm_clock_step_mhz))[::-1]


PROFILES: dict[str, GpuProfile] = {}


def _add(p: GpuProfile) -> None:
    PROFILES[p.key] = p


# A 16 GB consumer card like the seed's (MTP speculative decode, 150-320 W range). Tuned so that
# the seed's manual study comes out: at 220 W about 7% slower and about 14% less J/token than at
# 300 W, with 180 W costing more than 10% of the speed. See docs/simulator.md.
_add(
    GpuProfile(
        key="seed-16g",
        name="Simulated GeForce RTX 16GB (seed card)",
        architecture="ada",
        memory_total_bytes=16 * GIB,
        min_limit_w=150,
        max_limit_w=320,
        default_limit_w=300,
        idle_power_w=22,
        static_power_w=41,
        mem_power_w=39,
        dyn_power_w=240,
        sm_base_activity=0.79,
        sm_clock_min_mhz=510,
        sm_clock_max_mhz=2790,
        sm_clock_idle_mhz=210,
        sm_clock_step_mhz=15,
        mem_clock_mhz=10251,
        volt_min_v=0.61,
        volt_max_v=1.10,
        workload=WorkloadDefaults(
            decode_tok_s=87.0,
            prefill_tok_s=2400.0,
            decode_compute_share=0.45,
            speculative=True,
            draft_n_max=3,
            # Per-position acceptance 0.88, 0.74, 0.60, 0.46, 0.32 and 11.9% step cost per draft
            # token: draft 3 is fastest for one stream (acceptance 64% there; the seed measured 65%).
            draft_acceptance=0.88,
            draft_acceptance_decay=0.14,
            draft_cost=0.119,
            # The seed's memory account: 16 GB; one slot, draft 3 takes 80K context of q8_0 KV and
            # 96K is 384 MiB short; recurrent state 150 MiB per sequence and snapshot.
            weights_bytes=12328 * 1024**2,
            kv_bytes_per_token=40 * 1024,
            state_bytes_per_seq=150 * 1024**2,
            # 16 of 64 layers attend: decode slows gently with context.
            ctx_tokens_double=160_000.0,
        ),
    )
)

_add(
    GpuProfile(
        key="a100-40g",
        mig_capable=True,
        name="Simulated NVIDIA A100-SXM4-40GB",
        architecture="ampere",
        memory_total_bytes=40 * GIB,
        min_limit_w=100,
        max_limit_w=400,
        default_limit_w=400,
        idle_power_w=55,
        static_power_w=80,
        mem_power_w=110,
        dyn_power_w=260,
        sm_base_activity=0.35,
        sm_clock_min_mhz=210,
        sm_clock_max_mhz=1410,
        sm_clock_idle_mhz=210,
        sm_clock_step_mhz=15,
        mem_clock_mhz=1215,
        volt_min_v=0.65,
        volt_max_v=1.05,
        workload=WorkloadDefaults(decode_tok_s=95.0, prefill_tok_s=9000.0, decode_compute_share=0.18),
        power_avg_window_s=0.0,  # GA100: nvmlDeviceGetPowerUsage is instant power (NVML reference)
    )
)

# Decode on an H200 draws far below its 700 W limit: most caps never bind (field notes).
_add(
    GpuProfile(
        key="h200-141g",
        mig_capable=True,
        name="Simulated NVIDIA H200",
        architecture="hopper",
        memory_total_bytes=141 * GIB,
        min_limit_w=200,
        max_limit_w=700,
        default_limit_w=700,
        idle_power_w=78,
        static_power_w=90,
        mem_power_w=90,
        dyn_power_w=300,
        sm_base_activity=0.3,
        sm_clock_min_mhz=345,
        sm_clock_max_mhz=1980,
        sm_clock_idle_mhz=345,
        sm_clock_step_mhz=15,
        mem_clock_mhz=3201,
        volt_min_v=0.67,
        volt_max_v=1.0,
        workload=WorkloadDefaults(decode_tok_s=150.0, prefill_tok_s=20000.0, decode_compute_share=0.12),
        # Measured on a real H200 (driver 580.159.04, docs/hardware.md): the counter changes every
        # 100 ms, and each read of it costs 2.3-2.9 ms of CPU (p99 15 ms), the same through
        # nvmlDeviceGetFieldValues (fields 83 and 191); idle power 78 W at 345 MHz. Instant power (field 186)
        # changed value every 101 ms under load (its driver timestamp every 2.8 ms: the stamp does not date the value).
        energy_counter_update_s=0.1,
        instant_power_update_s=0.1,
        energy_counter_call_s=(0.0029, 0.015),
    )
)

# An older card: no energy counter, no instant power field. Exercises the fallbacks.
_add(
    GpuProfile(
        key="pascal-8g",
        name="Simulated GeForce GTX 1080",
        architecture="pascal",
        memory_total_bytes=8 * GIB,
        min_limit_w=90,
        max_limit_w=217,
        default_limit_w=180,
        idle_power_w=10,
        static_power_w=35,
        mem_power_w=35,
        dyn_power_w=120,
        sm_base_activity=0.4,
        sm_clock_min_mhz=607,
        sm_clock_max_mhz=1911,
        sm_clock_idle_mhz=139,
        sm_clock_step_mhz=13,
        mem_clock_mhz=5005,
        volt_min_v=0.7,
        volt_max_v=1.06,
        workload=WorkloadDefaults(decode_tok_s=30.0, prefill_tok_s=600.0, decode_compute_share=0.25),
        has_energy_counter=False,
        has_instant_power=False,
        power_avg_window_s=0.0,
        driver_version="535.183.01",
    )
)

# A 72 W inference card: the small one beside a big card on mixed hosts. Its whole power range (40-72 W) lies
# below an H200's or A100's minimum: no watt level is valid on both (docs/simulator.md, "Mixed hosts").
_add(
    GpuProfile(
        key="l4-24g",
        name="Simulated NVIDIA L4",
        architecture="ada",
        memory_total_bytes=24 * GIB,
        min_limit_w=40,
        max_limit_w=72,
        default_limit_w=72,
        idle_power_w=16,
        static_power_w=14,
        mem_power_w=16,
        dyn_power_w=58,
        sm_base_activity=0.35,
        sm_clock_min_mhz=210,
        sm_clock_max_mhz=2040,
        sm_clock_idle_mhz=210,
        sm_clock_step_mhz=15,
        mem_clock_mhz=6251,
        volt_min_v=0.65,
        volt_max_v=1.05,
        workload=WorkloadDefaults(decode_tok_s=40.0, prefill_tok_s=3000.0, decode_compute_share=0.2),
    )
)

DEFAULT_PROFILE = "seed-16g"

# The most GPUs one simulated host has (indexes 0 to MAX_SIM_GPUS - 1): `--gpus` with `--simulate`, the daemon's
# --sim-gpus and SimNVML itself. Without it `--gpus 1000000` built a million GPUs (4.4 GB) and 20 digits overflowed.
MAX_SIM_GPUS = 64


def get_profiles(spec) -> list[GpuProfile]:
    """One profile per GPU from a key, "key1,key2,…" (a mixed host, in index order), a profile, or a list of keys or
    profiles. KeyError naming the choices for an unknown key."""
    items = spec.split(",") if isinstance(spec, str) else (spec if isinstance(spec, (list, tuple)) else [spec])
    out = [get_profile(k.strip()) if isinstance(k, str) else k for k in items]
    if not out:
        raise KeyError("no simulated GPU profile given")
    return out


def get_profile(key: str) -> GpuProfile:
    try:
        return PROFILES[key]
    except KeyError:
        raise KeyError(f"unknown simulated GPU profile {key!r}; choose one of: {', '.join(PROFILES)}") from None
