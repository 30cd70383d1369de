// How a kernel leaves a parameter gradient it computes: written over what is there, or added to
// it (gradient accumulation: the micro-batches of one optimizer step sum into one buffer).
#pragma once

enum class GradWrite { Overwrite, Accumulate };
