#pragma once
// Functions that GPU kernels share with host code (counter-based random numbers) are marked
// TS_HOST_DEVICE. The GPU backend's vendor header defines it as host-and-device before it
// includes them; everywhere else they are plain inline functions, so core/ names no vendor.
#ifndef TS_HOST_DEVICE
#define TS_HOST_DEVICE inline
#endif
