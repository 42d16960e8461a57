"""The SSD speedup model (ALGORITHMS.md §4.2 Theorem 7, §4.5 Theorem 17).

Latencies are in units of one target verification: T_p is the primary speculator's cache fill,
T_b the backup's drafting after a miss. E_hit / E_miss are tokens emitted per round after a hit /
a miss. The speedup is over a decoder that emits one token per verification.
"""

from __future__ import annotations


def ssd_speedup(p_hit: float, e_hit: float, e_miss: float, t_p: float, t_b: float) -> float:
    """Theorem 7: (p E_hit + (1−p) E_miss) / (p max(1, T_p) + (1−p)(1 + T_b))."""
    return (p_hit * e_hit + (1 - p_hit) * e_miss) / (p_hit * max(1.0, t_p) + (1 - p_hit) * (1 + t_b))


def sd_speedup(e_sd: float, t_sd: float) -> float:
    """Synchronous SD in the same model: E_SD / (1 + T_SD)."""
    return e_sd / (1 + t_sd)


def neural_backup_speedup(batch: int, p_hit: float, e_hit: float, e_sd: float, t_p: float, t_b: float) -> float:
    """[derived, §4.5] Any miss among b rows stalls the whole batch for a just-in-time draft."""
    all_hit = p_hit ** batch
    return (p_hit * e_hit + (1 - p_hit) * e_sd) / (all_hit * max(1.0, t_p) + (1 - all_hit) * (1 + t_b))


def fast_backup_speedup(p_hit: float, e_hit: float, e_fast: float, t_p: float) -> float:
    """[derived, §4.5] Random-token backups cost nothing (T_b ≈ 0) and emit E_fast ≈ 1 per miss."""
    return (p_hit * e_hit + (1 - p_hit) * e_fast) / max(1.0, t_p)


def best_backup(batch: int, p_hit: float, e_hit: float, e_sd: float, e_fast: float, t_p: float, t_b: float) -> str:
    """Theorem 17: neural below the critical batch size b*, fast above it."""
    neural = neural_backup_speedup(batch, p_hit, e_hit, e_sd, t_p, t_b)
    return "neural" if neural >= fast_backup_speedup(p_hit, e_hit, e_fast, t_p) else "fast"
