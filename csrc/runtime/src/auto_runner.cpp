// backend "auto": ONNX Runtime (the C++ runtime's choice), except for the batch sizes the manifest's
// tuning table gives to an AOTInductor package, where the table was timed on a machine like this one.
//
// A call goes by its batch size as deploykit.load(backend="auto") routes it (deploykit/tuning/route.py):
// to the choice of that tuned size, else of the nearest tuned size above that takes it, else the nearest
// below (an AOTInductor choice takes the sizes of its packages); a choice that cannot run here (no
// libtorch, no consent, another torch, another GPU) leaves its sizes to ONNX Runtime, with a note in
// describe(). An aoti choice names its packages as deploykit tune records them: a kind
// ({"packages": "static"}) or one file ({"file": ...}).
#include <map>

#include "bundle.hpp"
#include "internal.hpp"

namespace deploykit::detail {
namespace {

struct Route {
  int64_t batch;
  Runner* runner;  // nullptr: ONNX Runtime, which takes every batch size
  std::string label;
  bool takes(int64_t size) const { return !runner || aoti_takes(*runner, size); }
};

class AutoRunner : public Runner {
 public:
  AutoRunner(const Bundle& bundle, const Options& options) : onnxruntime_(open_onnxruntime(bundle, options)) {
    if (!bundle.has_tuning()) return;
    Tuning tuning = bundle.tuning();
    std::string problem = tuning_problem(tuning, options.device);
    if (!problem.empty()) {
      notes_ += "; tuning not used: " + problem;
      return;
    }
    for (const auto& choice : tuning.choices) {
      Route route{choice.batch, nullptr, "onnxruntime"};
      const std::string batch = "; batch " + std::to_string(choice.batch) + ": the tuned " + choice.backend;
      if (choice.backend == "aoti") route = aoti_route(bundle, options, tuning.device, choice);
      else if (choice.backend == "openvino") notes_ += batch + " runs in Python's deploykit.load only (no OpenVINO here)";
      else if (choice.backend != "onnxruntime") notes_ += batch + " runs with --backend " + choice.backend + " only";
      routes_.push_back(route);
    }
  }

  const std::vector<TensorInfo>& inputs() const override { return onnxruntime_->inputs(); }
  const std::vector<TensorInfo>& outputs() const override { return onnxruntime_->outputs(); }

  std::string describe() const override {
    std::string text = "auto:";
    for (const auto& route : routes_) text += " batch " + std::to_string(route.batch) + " -> " + route.label + ";";
    text += routes_.empty() ? " onnxruntime (no tuning table for this machine)" : " other sizes by the nearest";
    text += notes_ + "\n" + onnxruntime_->describe();
    for (const auto& [file, runner] : aoti_) text += runner ? "\n" + runner->describe() : "";
    return text;
  }

  Tensors run(const Tensors& given) override {
    int64_t batch = 1;
    for (const auto& info : inputs()) {
      auto found = given.find(info.name);
      if (found != given.end() && !found->second.shape.empty()) batch = found->second.shape[0];
      if (found != given.end()) break;
    }
    Runner* chosen = route_for(batch);
    return (chosen ? chosen : onnxruntime_.get())->run(given);
  }

 private:
  // The AOTInductor runner of the packages the choice names (a kind, or one file) on the tuned device,
  // opened once per choice of packages; packages that cannot run here leave the route to ONNX Runtime.
  Route aoti_route(const Bundle& bundle, const Options& options, const std::string& device, const TunedChoice& choice) {
    std::string label = "aoti " + (choice.file.empty() ? choice.packages : choice.file);
    if (!aoti_.count(label)) {
      Options own = options;
      own.aoti_device = device;
      own.aoti_packages = choice.packages;
      own.aoti_package = choice.file;
      try {
        aoti_[label] = open_aoti(bundle, own);
      } catch (const Error& error) {
        notes_ += "; batch " + std::to_string(choice.batch) + ": the tuned " + label + " does not run here (" +
                  error.what() + "): onnxruntime instead";
        aoti_[label] = nullptr;
      }
    }
    Runner* runner = aoti_[label].get();
    return {choice.batch, runner, runner ? label : "onnxruntime"};
  }

  Runner* route_for(int64_t batch) const {
    const Route* above = nullptr;
    const Route* below = nullptr;
    for (const auto& route : routes_) {
      if (!route.takes(batch)) continue;
      if (route.batch == batch) return route.runner;
      if (route.batch > batch && (!above || route.batch < above->batch)) above = &route;
      if (route.batch < batch && (!below || route.batch > below->batch)) below = &route;
    }
    const Route* chosen = above ? above : below;
    return chosen ? chosen->runner : nullptr;
  }

  std::unique_ptr<Runner> onnxruntime_;
  std::map<std::string, std::unique_ptr<Runner>> aoti_;
  std::vector<Route> routes_;
  std::string notes_;
};

}  // namespace

std::unique_ptr<Runner> open_auto(const Bundle& bundle, const Options& options) {
  return std::make_unique<AutoRunner>(bundle, options);
}

}  // namespace deploykit::detail
