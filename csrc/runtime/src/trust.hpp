// Whether native code from a bundle may load here: the rule of deploykit/bundle/trust.py, so that
// deploykit-run and `deploykit run` take the same bundles (not installed).
#pragma once

#include <string>

namespace deploykit::detail {

class Bundle;

// The rule under which the bundle's native file `name` (its op library, an engine with plugins, an
// AOTInductor package) may load, as describe() names it: "written by this machine's deploykit",
// "same as this machine's build", "trusted with --trust-bundle"; "" when none applies. Judged on the
// manifest's sha256 of `name`, which verified_path / verified_bytes check the file's bytes against.
std::string native_rule(const Bundle& bundle, const std::string& name, bool trust_native);

// The one-line refusal of the bundle's native file `name` when native_rule is "", naming the rule and,
// after --trust-bundle, the runner's own ways out (", or --backend onnxruntime ...").
[[noreturn]] void refuse_native(const Bundle& bundle, const std::string& name, const std::string& ways_out);

}  // namespace deploykit::detail
