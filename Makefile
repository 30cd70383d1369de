# vit_train and its tests. `make` builds vit_train and the rate tools (gemm_rate, loader_rate,
# attention_rate, attention_trace, tma_rate, memory_rate, optimizer_rate, launch_gap,
# overlap_rate); `make test` builds and runs vit_tests: the CPU tier everywhere, the GPU tier where
# a GPU is present. The kernels are written for Hopper (sm_90a); ARCH can be overridden on the
# command line.
CUDA    ?= /usr/local/cuda
NVCC    ?= $(CUDA)/bin/nvcc
CXX     ?= g++
ARCH    ?= -gencode arch=compute_90a,code=sm_90a
BUILD   ?= build

INCLUDES  := -I. -I$(CUDA)/include
CXXFLAGS  := -std=c++17 -O2 -g -Wall -Wextra -Werror $(INCLUDES) -MMD -MP
# Under -Werror, ptxas refuses any kernel that spills registers or uses local memory: a spill is
# found when it is written, not in a profile. The traced attention build (attention_trace) is
# exempt: its phase stamps take registers.
NO_SPILLS := -Xptxas -warn-spills,-warn-lmem-usage
NVCCFLAGS_TRACED := -std=c++17 -O3 -lineinfo $(ARCH) -Werror all-warnings -Xcompiler -Wall,-Wextra $(INCLUDES) -MMD -MP
NVCCFLAGS := $(NVCCFLAGS_TRACED) $(NO_SPILLS)
LDFLAGS   := $(ARCH) -L$(CUDA)/lib64 -lcublasLt -lnccl -lz -lpthread -ldl -Xlinker -rpath,$(CUDA)/lib64
TEST_INCLUDES := -I/usr/include/eigen3

KERNELS := $(wildcard kernels/*.cu)
LIB_SRC := $(wildcard kernels/*.cpp model/*.cpp comm/*.cpp engine/*.cpp)
LIB_SRC := $(filter-out engine/main.cpp,$(LIB_SRC))
TEST_SRC := $(wildcard tests/*.cpp tests/reference/*.cpp)

LIB_OBJ  := $(KERNELS:%.cu=$(BUILD)/%.o) $(LIB_SRC:%.cpp=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.cpp=$(BUILD)/%.o)

.PHONY: all test fuzz bench profile clean build-deps test-deps fuzz-deps
all: vit_train gemm_rate loader_rate attention_rate attention_trace tma_rate memory_rate optimizer_rate launch_gap \
     overlap_rate

vit_train: $(LIB_OBJ) $(BUILD)/engine/main.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# The tests also decode images (tools/image_decode.cpp): libturbojpeg and libpng linked statically,
# as in pack_images, so that the binary runs where only it is copied.
IMAGE_LIBS = $(shell $(CXX) -print-file-name=libturbojpeg.a) $(shell $(CXX) -print-file-name=libpng16.a)
vit_tests: $(LIB_OBJ) $(TEST_OBJ) $(BUILD)/tools/image_decode.o
	$(NVCC) -o $@ $^ $(IMAGE_LIBS) $(LDFLAGS) -lm

# The dataset packer (CPU only; libturbojpeg and libpng: Debian libturbojpeg0-dev libpng-dev).
# Linked statically against them, so that it also runs where only the binary is copied.
pack_images: $(BUILD)/tools/pack_images.o $(BUILD)/tools/image_decode.o $(BUILD)/engine/regular_file.o
	$(CXX) -o $@ $^ -Wl,-Bstatic -lturbojpeg -lpng -lz -Wl,-Bdynamic -lm -lpthread

$(BUILD)/tools/pack_images.o $(BUILD)/tools/image_decode.o: | test-deps

# The packed data path's images/s on one GPU, augmentation included.
loader_rate: $(LIB_OBJ) $(BUILD)/tools/loader_rate.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# The fused attention alone at ViT shapes (tools/attention_bench.py: PyTorch's backends).
attention_rate: $(LIB_OBJ) $(BUILD)/tools/attention_rate.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# The resident attention kernels' phases, CTA by CTA: their files compiled again with the stamps.
TRACED := kernels/attention_resident_forward kernels/attention_resident_backward
TRACED_OBJ := $(TRACED:%=$(BUILD)/traced/%.o)
attention_trace: $(filter-out $(TRACED:%=$(BUILD)/%.o),$(LIB_OBJ)) $(TRACED_OBJ) $(BUILD)/tools/attention_trace.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

$(BUILD)/traced/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS_TRACED) -DATTENTION_TRACE -c $< -o $@

# The TMA unit's rate at the resident attention kernels' tiles, by box geometry.
tma_rate: $(BUILD)/tools/tma_rate.o $(BUILD)/kernels/check.o $(BUILD)/kernels/spin.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# The memory-bound kernels' rates (LayerNorm, GELU, FP8 casts) at one ViT's FP8 shapes, and the
# bf16 step's GELU kernels.
memory_rate: $(LIB_OBJ) $(BUILD)/tools/memory_rate.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# A step as two concurrent halves of the batch against one whole (issue 33's overlap lever).
overlap_rate: $(LIB_OBJ) $(BUILD)/tools/overlap_rate.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# The optimizer kernels over one model's parameters against the card's copy rate.
optimizer_rate: $(LIB_OBJ) $(BUILD)/tools/optimizer_rate.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# What a kernel boundary costs, on a stream and inside a CUDA graph.
launch_gap: $(BUILD)/tools/launch_gap.o $(BUILD)/kernels/check.o $(BUILD)/kernels/spin.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# cuBLASLt's rate at one ViT block's GEMM shapes, through the engine's GEMM entry point.
gemm_rate: $(LIB_OBJ) $(BUILD)/tools/gemm_rate.o
	$(NVCC) -o $@ $^ $(LDFLAGS)

# ptxas reports wgmmas it serialized (C7512 for want of registers, and its kin) as info, not a
# warning: the build fails on it as on a spill.
$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@ 2> $@.log; status=$$?; cat $@.log >&2; \
	  if grep -q "wgmma.mma_async instructions are serialized" $@.log; then \
	    echo "$<: ptxas serialized wgmma instructions" >&2; rm -f $@; exit 1; fi; \
	  exit $$status

$(BUILD)/tests/%.o: tests/%.cpp | test-deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $(TEST_INCLUDES) -c $< -o $@

$(BUILD)/%.o: %.cpp | build-deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c $< -o $@

# Debian packages the build needs (zlib; for the tests also Eigen, doctest, libturbojpeg and
# libpng): installed when missing (as root), or the exact command to run is printed.
build-deps:
	@tools/ensure_deps.sh build
test-deps:
	@tools/ensure_deps.sh test

test: test-deps vit_train vit_tests pack_images $(BUILD)/stub/kernels/cudnn_attention.o
	./vit_tests

# kernels/cudnn_attention.cpp as it builds without cuDNN's headers (a stub that says so),
# compiled by `make test` so that the stub keeps building.
$(BUILD)/stub/kernels/cudnn_attention.o: kernels/cudnn_attention.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -DVIT_WITHOUT_CUDNN -c $< -o $@

# Fuzz targets (tests/fuzz/): every reader of untrusted files (safetensors, checkpoint state,
# IDX, packed shards, pack_images' decoding) under libFuzzer with ASan and UBSan, built by
# Debian's clang, and their seed corpora (build/fuzz/seeds/TARGET/). tests/fuzz/run.sh runs them.
FUZZ_CXX   ?= clang++
FUZZ_SAN   := -fsanitize=address,undefined -fno-sanitize-recover=all
FUZZ_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer $(FUZZ_SAN) -fsanitize=fuzzer-no-link $(INCLUDES) -MMD -MP
FUZZ_TARGETS := safetensors checkpoint_state idx packed_shard image_decode
FUZZ_BIN := $(FUZZ_TARGETS:%=$(BUILD)/fuzz/fuzz_%)
FUZZ_LIBS := -lturbojpeg -lpng -lz -lpthread
FUZZ_SRC_safetensors      := engine/safetensors.cpp engine/regular_file.cpp
FUZZ_SRC_checkpoint_state := engine/checkpoint_format.cpp engine/resample.cpp engine/safetensors.cpp engine/regular_file.cpp \
                             engine/cli.cpp engine/checkpoint_dir.cpp engine/dataset.cpp model/params.cpp \
                             model/config.cpp
FUZZ_SRC_idx              := engine/dataset.cpp engine/regular_file.cpp
FUZZ_SRC_packed_shard     := engine/packed_format.cpp
FUZZ_SRC_image_decode     := tools/image_decode.cpp
FUZZ_SEED_SRC := $(FUZZ_SRC_checkpoint_state) engine/packed_format.cpp tools/image_decode.cpp
fuzz_objects = $(patsubst %.cpp,$(BUILD)/fuzz/obj/%.o,$(1))

fuzz: fuzz-deps $(FUZZ_BIN) $(BUILD)/fuzz/seeds/.made

.PRECIOUS: $(BUILD)/fuzz/obj/%.o
$(BUILD)/fuzz/obj/%.o: %.cpp | fuzz-deps
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) $(FUZZ_FLAGS) -c $< -o $@

.SECONDEXPANSION:
$(BUILD)/fuzz/fuzz_%: $(BUILD)/fuzz/obj/tests/fuzz/fuzz_%.o $$(call fuzz_objects,$$(FUZZ_SRC_$$*))
	$(FUZZ_CXX) $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $^ $(FUZZ_LIBS)

$(BUILD)/fuzz/make_seeds: $(BUILD)/fuzz/obj/tests/fuzz/make_seeds.o $(call fuzz_objects,$(FUZZ_SEED_SRC))
	$(FUZZ_CXX) $(FUZZ_SAN) -o $@ $^ $(FUZZ_LIBS)

$(BUILD)/fuzz/seeds/.made: $(BUILD)/fuzz/make_seeds
	$(BUILD)/fuzz/make_seeds $(BUILD)/fuzz/seeds && touch $@

fuzz-deps:
	@tools/ensure_deps.sh fuzz

# The speed round on a GPU machine: engine vs PyTorch eager on ViT-H, batch 64 (tools/bench.sh),
# and cuBLASLt's rate at the block's GEMM shapes.
bench: vit_train gemm_rate
	tools/bench.sh
	./gemm_rate

# An Nsight Systems capture of steps 10..14. nsys is a separate install (NVIDIA Nsight Systems).
profile: vit_train
	@command -v nsys >/dev/null || { echo "make profile needs Nsight Systems' nsys on the PATH (a separate install: https://developer.nvidia.com/nsight-systems); the capture it would run: nsys profile --capture-range=cudaProfilerApi --trace=cuda,nvtx ./vit_train --steps 15 --profile-steps 10:14" >&2; exit 1; }
	nsys profile --capture-range=cudaProfilerApi --trace=cuda,nvtx -o vit_train_profile \
	  ./vit_train --steps 15 --profile-steps 10:14

clean:
	rm -rf $(BUILD) vit_train vit_tests gemm_rate pack_images loader_rate attention_rate attention_trace tma_rate memory_rate \
	  optimizer_rate launch_gap overlap_rate

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
