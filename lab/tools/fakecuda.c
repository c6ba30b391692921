// A stand-in for libcuda.so.1 that lets Mosaic GPU's compiler run on a
// machine without a GPU (see tools/mosaic_cpu_compile.py).
//
// The XLA CUDA plugin's MosaicGpuCompile asks the driver for the current
// device and its compute capability, lowers the kernel's MLIR to PTX, runs
// ptxas for sm_90a and loads the cubin. This library answers those calls as
// one H100 would (compute capability 9.0) and "loads" modules without doing
// anything, so the PTX, the ptxas report and the SASS come out of the dumps.
// Nothing can be launched with it.
#include <stddef.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;  // 0 = CUDA_SUCCESS

static char fake_handle[64];

CUresult cuGetErrorString(CUresult error, const char** text) {
  static char buffer[64];
  snprintf(buffer, sizeof buffer, "fakecuda: error %d", error);
  *text = buffer;
  return 0;
}
CUresult cuGetErrorName(CUresult error, const char** text) { return cuGetErrorString(error, text); }
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int* version) { *version = 13000; return 0; }
CUresult cuDeviceGetCount(int* count) { *count = 1; return 0; }
CUresult cuDeviceGet(int* device, int ordinal) { *device = ordinal; return 0; }
CUresult cuCtxGetDevice(int* device) { *device = 0; return 0; }
CUresult cuCtxGetCurrent(void** context) { *context = fake_handle; return 0; }
CUresult cuCtxPushCurrent(void* context) { return 0; }
CUresult cuCtxPopCurrent(void** context) { *context = fake_handle; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** context, int device) { *context = fake_handle; return 0; }
CUresult cuDeviceGetName(char* name, int length, int device) {
  strncpy(name, "fakecuda H100", (size_t)length);
  return 0;
}
CUresult cuDeviceGetAttribute(int* value, int attribute, int device) {
  switch (attribute) {
    case 75: *value = 9; break;  // compute capability, major
    case 76: *value = 0; break;  // minor
    case 16: *value = 132; break;  // multiprocessors
    case 8: *value = 48 * 1024; break;  // shared memory per block
    case 97: *value = 227 * 1024; break;  // shared memory per block, opt-in
    case 81: *value = 228 * 1024; break;  // shared memory per multiprocessor
    default: *value = 0;
  }
  return 0;
}
CUresult cuModuleLoadData(void** module, const void* image) { *module = fake_handle; return 0; }
CUresult cuModuleLoadDataEx(void** module, const void* image, unsigned n, void* options, void** values) {
  *module = fake_handle;
  return 0;
}
CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
  *function = fake_handle + 8;
  return 0;
}
CUresult cuModuleGetGlobal(void** pointer, size_t* bytes, void* module, const char* name) {
  static char global[256];
  *pointer = global;
  if (bytes) *bytes = sizeof global;
  return 0;
}
CUresult cuModuleUnload(void* module) { return 0; }
CUresult cuFuncSetAttribute(void* function, int attribute, int value) { return 0; }
CUresult cuFuncGetAttribute(int* value, int attribute, void* function) { *value = 0; return 0; }
