// Runs PyTorch-trained weights in sdpa: loads a ScaledDotProductAttention's tensors from a safetensors
// file written by scripts/models/export_pytorch.py (or any safetensors writer), runs it on the inputs stored
// beside them and prints the output shape and the largest difference from PyTorch's own output.
//
//   load_pytorch [MODEL.safetensors [PREFIX [INPUTS.safetensors [H]]]]
//
// Defaults: the committed fixture tests/fixtures/safetensors/sdpa_f32.safetensors, the prefix and the head
// count from the file's metadata ("prefix", "h"), and sdpa_io.safetensors beside the model. d_model, d_k
// and d_v follow from the tensors' shapes; the number of heads does not, hence metadata or H. F64 files
// run in double, the others (F32, F16, BF16) in float.
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include <sdpa/io/safetensors.hpp>
#include <sdpa/sdpa.hpp>

namespace {

template <typename Scalar>
Eigen::Tensor<Scalar, 3, Eigen::RowMajor> input(const sdpa::SafetensorsFile& file, const std::string& name) {
  const sdpa::SafetensorsTensor* t = file.find(name);
  if (t == nullptr || t->shape.size() != 3)
    throw std::runtime_error("'" + file.name + "' has no rank-3 tensor named '" + name + "'");
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> out(t->shape[0], t->shape[1], t->shape[2]);
  const std::vector<Scalar> values = sdpa::tensor_values<Scalar>(file, *t);
  std::copy(values.begin(), values.end(), out.data());
  return out;
}

template <typename Scalar>
int run(const sdpa::SafetensorsFile& model_file, const std::string& prefix, Eigen::Index h,
        const std::string& inputs_path, const std::string& dtype) {
  const sdpa::SafetensorsTensor* q = model_file.find(prefix + "fc_q.weight");
  const sdpa::SafetensorsTensor* v = model_file.find(prefix + "fc_v.weight");
  if (q == nullptr || v == nullptr || q->shape.size() != 2 || v->shape.size() != 2)
    throw std::runtime_error("no 2-d " + prefix + "fc_q.weight / fc_v.weight in '" + model_file.name + "'");
  const Eigen::Index d_model = q->shape[1];
  if (h <= 0 || q->shape[0] % h != 0 || v->shape[0] % h != 0)
    throw std::runtime_error("h = " + std::to_string(h) + " does not divide the projections' widths");
  sdpa::ScaledDotProductAttention<Scalar> attention(d_model, q->shape[0] / h, v->shape[0] / h, h);
  sdpa::load_safetensors(attention, model_file, prefix);
  attention.eval();  // PyTorch's reference output is eval(): no dropout
  std::cout << "loaded " << model_file.name << " (" << dtype << ", prefix '" << prefix << "'): d_model " << d_model
            << ", d_k " << attention.d_k() << ", d_v " << attention.d_v() << ", h " << h << "\n";

  const sdpa::SafetensorsFile io = sdpa::read_safetensors(inputs_path);
  const std::string suffix = sizeof(Scalar) == 4 ? "_f32" : "_f64";
  const auto output = attention(input<Scalar>(io, "queries" + suffix), input<Scalar>(io, "keys" + suffix),
                                input<Scalar>(io, "values" + suffix));
  std::cout << "output shape (" << output.dimension(0) << ", " << output.dimension(1) << ", " << output.dimension(2)
            << ")\n";

  std::string lower = dtype;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (io.find("output_" + lower) == nullptr) {
    std::cout << "no output_" << lower << " in " << inputs_path << " to compare with\n";
    return 0;
  }
  const auto expected = input<Scalar>(io, "output_" + lower);
  double diff = 0, scale = 0;
  for (Eigen::Index i = 0; i < expected.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(output.data()[i]) - static_cast<double>(expected.data()[i])));
    scale = std::max(scale, std::abs(static_cast<double>(expected.data()[i])));
  }
  std::cout << "max |sdpa - PyTorch| = " << diff << " (relative to max |PyTorch| = " << scale << ": "
            << (scale > 0 ? diff / scale : diff) << ")\n";
  // Far beyond rounding: the weights did not land where PyTorch had them.
  const double tolerance = sizeof(Scalar) == 4 ? 1e-4 : 1e-10;
  if (!(diff <= tolerance * scale)) {
    std::cerr << "load_pytorch: the output differs from PyTorch's by more than " << tolerance << " relative\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string default_dir = std::string(SDPA_FIXTURE_DIR) + "/safetensors/";
  const std::string model_path = argc > 1 ? argv[1] : default_dir + "sdpa_f32.safetensors";
  try {
    const sdpa::SafetensorsFile model = sdpa::read_safetensors(model_path);
    auto meta = [&](const std::string& key) {
      auto it = model.metadata.find(key);
      return it == model.metadata.end() ? std::string() : it->second;
    };
    const std::string prefix = argc > 2 ? argv[2] : meta("prefix");
    const std::string inputs = argc > 3 ? argv[3]
                                        : (std::filesystem::path(model_path).parent_path() / "sdpa_io.safetensors").string();
    const std::string h_text = argc > 4 ? argv[4] : meta("h");
    if (h_text.empty()) throw std::runtime_error("the number of heads is not in the metadata: pass H");
    const Eigen::Index h = std::strtol(h_text.c_str(), nullptr, 10);
    const sdpa::SafetensorsTensor* q = model.find(prefix + "fc_q.weight");
    const std::string dtype = q ? q->dtype : "F32";
    return dtype == "F64" ? run<double>(model, prefix, h, inputs, dtype) : run<float>(model, prefix, h, inputs, dtype);
  } catch (const std::exception& e) {
    std::cerr << "load_pytorch: " << e.what() << "\n";
    return 1;
  }
}
