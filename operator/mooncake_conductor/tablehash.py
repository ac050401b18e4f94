"""The key table's layout: slots per bucket and the two odd multipliers of its hashes."""

SLOTS = 4  #: slots per bucket (keys + one-word masks: one 64-byte cache line)
H1 = 0x9E3779B97F4A7C15  #: home bucket's multiplier (Fibonacci hashing)
H2 = 0xC2B2AE3D27D4EB4F  #: overflow bucket's multiplier
