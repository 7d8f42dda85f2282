// The autograd layer of the native ops in one translation unit: each header defines one op
// family's torch::autograd::Function and registers it for the Autograd dispatch key. The torch
// autograd and dispatcher headers take about 20 s to parse, most of each file's compile time;
// compiled as three translation units, the build parsed them three times.
#include "attention_autograd.h"
#include "block_step_autograd.h"
#include "depth_attention_autograd.h"
