// The Python module `attnres_kernels._C`: an empty module whose import loads
// this shared library and so runs the TORCH_LIBRARY registrations of the ops.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
