# dsbatch build. `make` builds build/dsbatch with the CPU backend, plus the CUDA backend when nvcc
# is found (SM=80 by default). `make help` lists the targets.
#
# Host code is C11 built with mpicc; CUDA files are kernel-only (no mpi.h) and built with nvcc.
# The CPU reference backend is compiled without -ffast-math and with -ffp-contract=off: it is the
# oracle for every GPU kernel and must reproduce the reference's fp32 roundings (no FMA fusion).

BUILD_DIR ?= build
GOLDEN    ?= ../shared/golden
SM        ?= 80
MPICC     ?= mpicc
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || ( [ -x $(CUDA_HOME)/bin/nvcc ] && echo $(CUDA_HOME)/bin/nvcc ))
HDF5_PC   ?= hdf5-openmpi

CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g -Wall -Wextra -Wno-unused-parameter -ffp-contract=off -fno-fast-math -fopenmp
OPT         ?= -O2
GIT_COMMIT  := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
CFLAGS      := $(CFLAGS_BASE) $(OPT) -Isrc -Ikernels -Impi $(shell pkg-config --cflags libcjson $(HDF5_PC) 2>/dev/null) $(shell pkg-config --cflags libpcre2-8 libutf8proc) -DDS_GIT_COMMIT='"$(GIT_COMMIT)"'
LDLIBS      := $(shell pkg-config --libs libcjson $(HDF5_PC) 2>/dev/null) -lzstd -lm -lpthread -fopenmp $(shell pkg-config --libs libpcre2-8 libutf8proc)

HOST_SRC  := $(filter-out src/main.c,$(wildcard src/*.c)) $(wildcard kernels/*.c) $(wildcard kernels/cpu/*.c) $(wildcard mpi/*.c)
HOST_OBJ  := $(patsubst %.c,$(BUILD_DIR)/obj/%.o,$(HOST_SRC))
CU_SRC    := $(wildcard kernels/cuda/*.cu)
TEST_SRC  := $(wildcard tests/unit/test_*.c)
TEST_BIN  := $(patsubst tests/unit/%.c,$(BUILD_DIR)/tests/%,$(TEST_SRC))
# MPI test programs (no cmocka: run under mpirun by tests/cli scripts, which print the TAP lines)
MPITEST_SRC := $(wildcard tests/mpi/*.c)
MPITEST_BIN := $(patsubst tests/mpi/%.c,$(BUILD_DIR)/mpitests/%,$(MPITEST_SRC))

ifneq ($(strip $(NVCC)),)
ifneq ($(strip $(CU_SRC)),)
WITH_CUDA := 1
endif
endif

BENCH_SRC :=
BENCH_BIN :=
ifeq ($(WITH_CUDA),1)
BENCH_SRC := $(wildcard tests/bench/*.c)
BENCH_BIN := $(patsubst tests/bench/%.c,$(BUILD_DIR)/bench/%,$(BENCH_SRC))
GENCODE   := -gencode arch=compute_$(SM),code=[sm_$(SM),compute_$(SM)]
NVFLAGS   := -O3 -std=c++17 $(GENCODE) -Ikernels -Isrc -Xptxas -v -lineinfo
CU_OBJ    := $(patsubst %.cu,$(BUILD_DIR)/obj/%.o,$(CU_SRC))
# the kernel timeline's CUDA injection library (tests/gpu/step_timeline.sh)
TRACE_LIB := $(BUILD_DIR)/bench/libcupti_trace.so
CFLAGS    += -DDS_HAVE_CUDA -I$(CUDA_HOME)/include
LDLIBS    += -L$(CUDA_HOME)/lib64 -lcudart_static -lnccl -ldl -lrt -lstdc++
endif

.PHONY: all cpu test test-cuda demo bench clean help
all: $(BUILD_DIR)/dsbatch $(TEST_BIN) $(MPITEST_BIN) $(BENCH_BIN) $(TRACE_LIB)

cpu:
	$(MAKE) WITH_CUDA=0 NVCC= all

$(BUILD_DIR)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD_DIR)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -MMD -MP -c $< -o $@ 2> $(BUILD_DIR)/obj/$*.ptxas.log || (cat $(BUILD_DIR)/obj/$*.ptxas.log; exit 1)

# the commit goes into every output file (/meta): its one user is rebuilt when HEAD moves
$(BUILD_DIR)/obj/src/jobout.o: $(BUILD_DIR)/commit-$(GIT_COMMIT)
$(BUILD_DIR)/commit-$(GIT_COMMIT):
	@mkdir -p $(BUILD_DIR) && rm -f $(BUILD_DIR)/commit-* && touch $@

$(BUILD_DIR)/libdsbatch.a: $(HOST_OBJ) $(CU_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD_DIR)/dsbatch: $(BUILD_DIR)/obj/src/main.o $(BUILD_DIR)/libdsbatch.a
	$(MPICC) -o $@ $^ $(LDLIBS)

$(BUILD_DIR)/tests/%: tests/unit/%.c $(BUILD_DIR)/libdsbatch.a
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) -MMD -MP -Itests -o $@ $< $(BUILD_DIR)/libdsbatch.a $(LDLIBS) -lcmocka

$(BUILD_DIR)/mpitests/%: tests/mpi/%.c $(BUILD_DIR)/libdsbatch.a
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) -Itests -o $@ $< $(BUILD_DIR)/libdsbatch.a $(LDLIBS)

$(BUILD_DIR)/bench/%: tests/bench/%.c $(BUILD_DIR)/libdsbatch.a
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) -Itests -o $@ $< $(BUILD_DIR)/libdsbatch.a $(LDLIBS)

$(BUILD_DIR)/bench/libcupti_trace.so: tests/gpu/cupti_trace.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wno-unused-parameter -fPIC -shared -I$(CUDA_HOME)/include \
		-o $@ $< -L$(CUDA_HOME)/lib64 -lcupti

test: all
	GOLDEN=$(abspath $(GOLDEN)) BUILD_DIR=$(BUILD_DIR) bash tests/run_tests.sh

# on the GPU machine: every op of the CUDA backend against the CPU backend, the whole model on
# the GPU (verify, batch invariance, 16 ranks sharing the GPU), the NCCL comm, the ptxas check
test-cuda: all
	$(BUILD_DIR)/tests/test_cuda_linear
	$(BUILD_DIR)/tests/test_cuda_ops
	$(BUILD_DIR)/tests/test_cuda_moe
	$(BUILD_DIR)/tests/test_cuda_ops_misc
	$(BUILD_DIR)/tests/test_cuda_attn
	$(BUILD_DIR)/tests/test_cuda_index
	$(BUILD_DIR)/tests/test_cuda_branch
	GOLDEN=$(abspath $(GOLDEN)) DSBATCH=$(BUILD_DIR)/dsbatch bash tests/cli/test_cuda_engine.sh
	MPITESTS=$(BUILD_DIR)/mpitests bash tests/cli/test_nccl.sh
	BUILD_DIR=$(BUILD_DIR) bash tests/cli/test_ptxas.sh

# on the GPU machine: the linear kernels per shape next to PyTorch (bf16 matmul on dequantized
# weights), the decode step and prefill of one rank's shard with its per-op profile, the decode
# step at a 2,048-token context (the index top-k then selects 512 of 1,024 rows), the head with
# its greedy draw on the host and on the GPU, the sparse attention and routed-expert ops next to PyTorch's, then the plots
# (results/*.png)
bench: all
	@mkdir -p results
	$(BUILD_DIR)/bench/bench_linear_cuda results/cuda_linear_decode.csv
	python3 tests/bench/torch_linear_baseline.py results/torch_linear_decode.csv
	$(BUILD_DIR)/bench/bench_step --backend cuda --csv results/cuda_step.csv --profile results/cuda_step_profile.csv
	$(BUILD_DIR)/bench/bench_step --backend cuda --exact-linears --csv results/cuda_step_exact.csv
	$(BUILD_DIR)/bench/bench_step --backend cuda --ctx 2048 --batch 1,8 --prefill "" --csv results/cuda_step_ctx2048.csv
	$(BUILD_DIR)/bench/bench_head_draw --csv results/cuda_head_draw.csv
	$(BUILD_DIR)/bench/bench_attn --csv results/cuda_attn.csv
	python3 tests/bench/torch_attn_baseline.py results/cuda_attn.csv
	$(BUILD_DIR)/bench/bench_moe --csv results/cuda_moe.csv
	python3 tests/bench/torch_moe_baseline.py results/cuda_moe.csv
	python3 tests/bench/plot_results.py results

demo: all
	bash tests/demo.sh

clean:
	rm -rf $(BUILD_DIR)

help:
	@echo "make            build $(BUILD_DIR)/dsbatch (CPU backend; + CUDA backend when nvcc is found, SM=$(SM))"
	@echo "make cpu        build without CUDA"
	@echo "make test       build and run every test (unit, golden, CLI); ends with 'N passed, N failed'"
	@echo "make demo       make the tiny model and run a generation on it"
	@echo "make bench      run the benchmarks (GPU machine) and write results/"
	@echo "make clean      remove $(BUILD_DIR)"
	@echo "variables: SM=80|86  GOLDEN=$(GOLDEN)  BUILD_DIR=$(BUILD_DIR)  MPICC=$(MPICC)  CUDA_HOME=$(CUDA_HOME)"

-include $(HOST_OBJ:.o=.d) $(CU_OBJ:.o=.d) $(BUILD_DIR)/obj/src/main.d $(TEST_BIN:=.d)
