"""Storage tiers: where tensors live between uses (device memory, host memory, NVMe, user tiers)."""
from .base import Tier, TierBudgetError, TierError, TransferHandle, format_bytes, parse_bytes
from .memory import DeviceTier, HostTier, MemoryTier, empty_host, pinned_memory_available
from .registry import register_tier, resolve_tier_class

register_tier("hbm", DeviceTier)
register_tier("host", HostTier)

__all__ = ["Tier", "TierBudgetError", "TierError", "TransferHandle", "DeviceTier", "HostTier", "MemoryTier",
           "register_tier", "resolve_tier_class", "format_bytes", "parse_bytes", "empty_host",
           "pinned_memory_available"]
