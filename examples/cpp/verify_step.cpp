// One speculative verify step with a specrt target plan and the TensorRT C++ runtime.
//
//   verify_step ENGINES/target.plan [VERIFY_TOKENS=4] [CONTEXT=8]
//
// What an app embedding specrt's engines does each step, in plain TensorRT 10:
//   * deserialize the plan (built by `specrt build --trt`; specrt's AOT plugins are inside it, so
//     no plugin library and no Python are loaded here),
//   * own the KV cache: one [B, Hkv, C, D] buffer pair per layer, allocated once and bound to the
//     past_key_i / past_value_i inputs by address - the plan reads the window it needs in place,
//   * feed the verify tokens with their positions, the masks (past_mask: which cache slots each new
//     token sees; tree_mask: which new tokens it sees - causal here, ancestor-or-self for a tree),
//   * read the logits of every verify row, then write the new K/V rows the app keeps into its cache
//     (the graph returns them as new_keys / new_values; it never writes the cache itself).
// The cache here holds zeros and the ids are arbitrary: the point is the binding, not the text.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#define CUDA_CHECK(call)                                                                        \
    do {                                                                                        \
        cudaError_t err_ = (call);                                                              \
        if (err_ != cudaSuccess) {                                                              \
            std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, \
                         __LINE__);                                                             \
            std::exit(1);                                                                       \
        }                                                                                       \
    } while (0)

namespace {

class Logger : public nvinfer1::ILogger {
  public:
    void log(Severity severity, char const* msg) noexcept override {
        if (severity <= Severity::kWARNING) std::fprintf(stderr, "[TensorRT] %s\n", msg);
    }
};

std::vector<char> readFile(std::string const& path) {
    std::ifstream file(path, std::ios::binary | std::ios::ate);
    if (!file) {
        std::fprintf(stderr, "cannot open %s (build it: specrt build --engines FOLDER --trt)\n", path.c_str());
        std::exit(2);
    }
    std::vector<char> data(static_cast<size_t>(file.tellg()));
    file.seekg(0);
    file.read(data.data(), static_cast<std::streamsize>(data.size()));
    return data;
}

size_t elementSize(nvinfer1::DataType type) {
    switch (type) {
        case nvinfer1::DataType::kFLOAT: return 4;
        case nvinfer1::DataType::kHALF: return 2;
        case nvinfer1::DataType::kBF16: return 2;
        case nvinfer1::DataType::kINT32: return 4;
        case nvinfer1::DataType::kINT64: return 8;
        case nvinfer1::DataType::kBOOL: return 1;
        default: std::fprintf(stderr, "unexpected tensor type\n"); std::exit(1);
    }
}

int64_t volume(nvinfer1::Dims const& d) {
    int64_t n = 1;
    for (int32_t i = 0; i < d.nbDims; ++i) n *= d.d[i];
    return n;
}

nvinfer1::Dims dims(std::vector<int64_t> const& values) {
    nvinfer1::Dims d{};
    d.nbDims = static_cast<int32_t>(values.size());
    for (size_t i = 0; i < values.size(); ++i) d.d[i] = values[i];
    return d;
}

// A device buffer that frees itself.
struct DeviceBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    explicit DeviceBuffer(size_t n) : bytes(n) { CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1))); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(DeviceBuffer const&) = delete;
    DeviceBuffer& operator=(DeviceBuffer const&) = delete;
};

template <typename T>
void upload(DeviceBuffer& buffer, std::vector<T> const& host, cudaStream_t stream) {
    CUDA_CHECK(cudaMemcpyAsync(buffer.ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s ENGINES/target.plan [VERIFY_TOKENS=4] [CONTEXT=8]\n", argv[0]);
        return 2;
    }
    int64_t const steps = argc > 2 ? std::atoll(argv[2]) : 4;    // T: anchor + drafts to verify
    int64_t const context = argc > 3 ? std::atoll(argv[3]) : 8;  // committed tokens already in the cache
    int64_t const batch = 1;

    Logger logger;
    std::vector<char> plan = readFile(argv[1]);
    std::unique_ptr<nvinfer1::IRuntime> runtime{nvinfer1::createInferRuntime(logger)};
    std::unique_ptr<nvinfer1::ICudaEngine> engine{runtime->deserializeCudaEngine(plan.data(), plan.size())};
    if (!engine) {
        std::fprintf(stderr, "cannot deserialize %s: built for another GPU or TensorRT version?\n", argv[1]);
        return 2;
    }
    std::unique_ptr<nvinfer1::IExecutionContext> ctx{engine->createExecutionContext()};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));
    int32_t const profile = 0;  // specrt records profile 0 as "step" (decode / verify)
    ctx->setOptimizationProfileAsync(profile, stream);

    // Cache geometry from the plan: past_key_0 is [batch, kv_heads, capacity, head_dim].
    nvinfer1::Dims const cacheMax = engine->getProfileShape("past_key_0", profile, nvinfer1::OptProfileSelector::kMAX);
    int64_t const kvHeads = cacheMax.d[1], capacity = cacheMax.d[2], headDim = cacheMax.d[3];
    nvinfer1::DataType const cacheType = engine->getTensorDataType("past_key_0");
    if (context + steps > capacity) {
        std::fprintf(stderr, "context %lld + %lld verify tokens exceed the plan's capacity %lld\n",
                     static_cast<long long>(context), static_cast<long long>(steps), static_cast<long long>(capacity));
        return 2;
    }
    int32_t layers = 0;
    while (engine->getTensorIOMode(("past_key_" + std::to_string(layers)).c_str()) == nvinfer1::TensorIOMode::kINPUT) {
        ++layers;
    }
    size_t const cacheBytes = static_cast<size_t>(batch * kvHeads * capacity * headDim) * elementSize(cacheType);
    std::vector<std::unique_ptr<DeviceBuffer>> keys, values;  // the app's own cache, allocated once
    for (int32_t l = 0; l < layers; ++l) {
        keys.push_back(std::make_unique<DeviceBuffer>(cacheBytes));
        values.push_back(std::make_unique<DeviceBuffer>(cacheBytes));
        CUDA_CHECK(cudaMemsetAsync(keys.back()->ptr, 0, cacheBytes, stream));
        CUDA_CHECK(cudaMemsetAsync(values.back()->ptr, 0, cacheBytes, stream));
    }

    // Step inputs: T tokens at positions context.., the cache window [0, context), causal tree mask.
    int64_t const window = context;
    std::vector<int64_t> ids(steps), positions(steps), rows(steps);
    std::vector<uint8_t> pastMask(steps * window, 1), treeMask(steps * steps, 0);
    for (int64_t t = 0; t < steps; ++t) {
        ids[t] = 1 + t;
        positions[t] = context + t;
        rows[t] = t;  // logits for every verify row
        for (int64_t u = 0; u <= t; ++u) treeMask[t * steps + u] = 1;
    }
    std::map<std::string, std::unique_ptr<DeviceBuffer>> owned;
    auto input = [&](char const* name, std::vector<int64_t> const& shape, auto const& host) {
        owned[name] = std::make_unique<DeviceBuffer>(host.size() * sizeof(host[0]));
        upload(*owned[name], host, stream);
        ctx->setInputShape(name, dims(shape));
        ctx->setTensorAddress(name, owned[name]->ptr);
    };
    input("input_ids", {batch, steps}, ids);
    input("position_ids", {batch, steps}, positions);
    input("past_mask", {batch, steps, window}, pastMask);
    input("tree_mask", {batch, steps, steps}, treeMask);
    input("logit_rows", {batch, steps}, rows);
    for (int32_t l = 0; l < layers; ++l) {
        std::string const k = "past_key_" + std::to_string(l), v = "past_value_" + std::to_string(l);
        ctx->setInputShape(k.c_str(), dims({batch, kvHeads, capacity, headDim}));
        ctx->setInputShape(v.c_str(), dims({batch, kvHeads, capacity, headDim}));
        ctx->setTensorAddress(k.c_str(), keys[l]->ptr);  // bound in place: no copy of the cache
        ctx->setTensorAddress(v.c_str(), values[l]->ptr);
    }
    // Outputs: shapes follow from the inputs once they are set.
    for (int32_t i = 0; i < engine->getNbIOTensors(); ++i) {
        char const* name = engine->getIOTensorName(i);
        if (engine->getTensorIOMode(name) != nvinfer1::TensorIOMode::kOUTPUT) continue;
        nvinfer1::Dims const shape = ctx->getTensorShape(name);
        owned[name] = std::make_unique<DeviceBuffer>(volume(shape) * elementSize(engine->getTensorDataType(name)));
        ctx->setTensorAddress(name, owned[name]->ptr);
    }
    if (!ctx->enqueueV3(stream)) {
        std::fprintf(stderr, "enqueueV3 failed\n");
        return 1;
    }

    // Greedy verification reads the argmax of each row's logits [batch, rows, vocab] (float32).
    nvinfer1::Dims const logitShape = ctx->getTensorShape("logits");
    int64_t const vocab = logitShape.d[2];
    std::vector<float> logits(static_cast<size_t>(volume(logitShape)));
    CUDA_CHECK(cudaMemcpyAsync(logits.data(), owned["logits"]->ptr, logits.size() * sizeof(float),
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int64_t t = 0; t < steps; ++t) {
        auto const* row = logits.data() + t * vocab;
        int64_t const best = std::max_element(row, row + vocab) - row;
        std::printf("row %lld: argmax token %lld (logit %.4f)\n", static_cast<long long>(t),
                    static_cast<long long>(best), row[best]);
    }

    // Keep the anchor and the first accepted draft (say): copy their new K/V rows, [L, B, Hkv, T, D],
    // into the cache slots context + 0 and context + 1. Rejected rows never touch the cache.
    int64_t const kept = std::min<int64_t>(2, steps);
    size_t const rowBytes = static_cast<size_t>(headDim) * elementSize(cacheType);
    for (int32_t l = 0; l < layers; ++l) {
        for (int64_t h = 0; h < kvHeads; ++h) {
            size_t const src = ((static_cast<size_t>(l) * batch * kvHeads + h) * steps) * rowBytes;
            size_t const dst = (static_cast<size_t>(h) * capacity + context) * rowBytes;
            CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(keys[l]->ptr) + dst,
                                       static_cast<char*>(owned["new_keys"]->ptr) + src, kept * rowBytes,
                                       cudaMemcpyDeviceToDevice, stream));
            CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(values[l]->ptr) + dst,
                                       static_cast<char*>(owned["new_values"]->ptr) + src, kept * rowBytes,
                                       cudaMemcpyDeviceToDevice, stream));
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::printf("verify step done: %d layers, cache %lld slots, %lld rows kept\n", layers,
                static_cast<long long>(capacity), static_cast<long long>(kept));
    CUDA_CHECK(cudaStreamDestroy(stream));
    return 0;
}
