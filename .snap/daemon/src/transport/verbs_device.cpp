// The verbs transport's native handles (one RAII alias each, verbs_transport.hpp), the device list and NIC discovery.
#include <spdlog/spdlog.h>

#include <array>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "transport/verbs_transport.hpp"

namespace tandem::daemon::transport {

namespace verbs {

void DeviceListDeleter::operator()(ibv_device** list) const noexcept { ibv_free_device_list(list); }
void ContextDeleter::operator()(ibv_context* ctx) const noexcept {
  if (int rc = ibv_close_device(ctx); rc != 0) spdlog::error("verbs: ibv_close_device -> {}", std::strerror(rc));
}
void PdDeleter::operator()(ibv_pd* pd) const noexcept {
  if (int rc = ibv_dealloc_pd(pd); rc != 0)
    spdlog::error("verbs: ibv_dealloc_pd -> {} (an MR or QP still uses it)", std::strerror(rc));
}
void MrDeleter::operator()(ibv_mr* mr) const noexcept {
  if (int rc = ibv_dereg_mr(mr); rc != 0) spdlog::error("verbs: ibv_dereg_mr -> {}", std::strerror(rc));
}
void CqDeleter::operator()(ibv_cq* cq) const noexcept {
  if (int rc = ibv_destroy_cq(cq); rc != 0)
    spdlog::error("verbs: ibv_destroy_cq -> {} (a QP still uses it)", std::strerror(rc));
}
void QpDeleter::operator()(ibv_qp* qp) const noexcept {
  if (int rc = ibv_destroy_qp(qp); rc != 0) spdlog::error("verbs: ibv_destroy_qp -> {}", std::strerror(rc));
}

void checkVerbs(int rc, std::string_view what, std::string_view call) {
  if (rc == 0) return;
  // Most verbs calls return an errno value; a few return -1 and set errno.
  const int err = rc < 0 ? errno : rc;
  fail(err == ENOMEM ? ErrorCode::kOutOfMemory : ErrorCode::kRdma, "{}: {} [{} -> errno {}]", what,
       std::strerror(err), call, err);
}

DeviceList getDeviceList() {
  DeviceList d;
  errno = 0;
  int n = 0;
  d.list.reset(ibv_get_device_list(&n));
  d.savedErrno = errno;
  d.count = d.list ? n : 0;
  return d;
}

namespace {
std::string realPath(const std::string& path) {
  std::array<char, PATH_MAX> buf{};
  if (::realpath(path.c_str(), buf.data()) == nullptr) return {};
  return std::string(buf.data());
}
int readNumaNode(const std::string& devicePath) {
  std::ifstream in(devicePath + "/numa_node");
  int node = -1;
  if (!(in >> node)) return -1;
  return node;
}
}  // namespace

std::vector<NicDesc> discoverNics() {
  std::vector<NicDesc> nics;
  DeviceList devices = getDeviceList();
  for (int i = 0; i < devices.count; ++i) {
    ibv_device* dev = devices.list.get()[i];
    NicDesc nic;
    nic.pci.name = ibv_get_device_name(dev);
    const std::string sysfs = "/sys/class/infiniband/" + nic.pci.name + "/device";
    nic.pci.pciPath = realPath(sysfs);
    nic.pci.numaNode = readNumaNode(sysfs);
    nic.active = false;
    IbvContext ctx(ibv_open_device(dev));
    if (ctx) {
      ibv_port_attr attr{};
      nic.active = ibv_query_port(ctx.get(), nic.port, &attr) == 0 && attr.state == IBV_PORT_ACTIVE;
    }
    nics.push_back(std::move(nic));
  }
  return nics;
}

}  // namespace verbs

}  // namespace tandem::daemon::transport
