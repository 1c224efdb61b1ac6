// One request's suffix trie for suffix drafting (speculative/methods/suffix.py): occurrence counts of every
// substring of at most max_depth tokens of the request's prompt and output, extended token by token. The same
// trie, the same match and the same best-first tree as the Python SuffixTrie (node for node, float for float):
// Python made ~23 objects per indexed token (~40 us each token), which on a 1,000-token prompt cost several decode
// steps. Nodes live in flat arrays; (parent, token) -> child in one open-addressing table; each node's children
// keep their creation order in a sibling list, as a Python dict keeps insertion order.
#include <torch/extension.h>

#include <cstdint>
#include <queue>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// (parent, token) -> child: linear probing over a power-of-two table, at most half full
class ChildTable {
 public:
  ChildTable() : keys_(64, kEmpty), vals_(64, 0) {}

  int32_t find(int32_t parent, int64_t token) const {
    const uint64_t key = pack(parent, token);
    for (size_t i = slot(key);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == key) return vals_[i];
      if (keys_[i] == kEmpty) return -1;
    }
  }

  void insert(int32_t parent, int64_t token, int32_t child) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    put(pack(parent, token), child);
    ++size_;
  }

  size_t bytes() const { return keys_.size() * (sizeof(uint64_t) + sizeof(int32_t)); }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  static uint64_t pack(int32_t parent, int64_t token) {
    return (uint64_t(uint32_t(parent)) << 32) | uint32_t(token);
  }
  size_t slot(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> 17) & (keys_.size() - 1); }
  void put(uint64_t key, int32_t val) {
    size_t i = slot(key);
    while (keys_[i] != kEmpty) i = (i + 1) & (keys_.size() - 1);
    keys_[i] = key;
    vals_[i] = val;
  }
  void grow() {
    std::vector<uint64_t> keys(keys_.size() * 2, kEmpty);
    std::vector<int32_t> vals(vals_.size() * 2, 0);
    keys.swap(keys_);
    vals.swap(vals_);
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != kEmpty) put(keys[i], vals[i]);
  }
  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t size_ = 0;
};

}  // namespace

class SuffixIndex {
 public:
  explicit SuffixIndex(int64_t max_depth) : max_depth_(max_depth) {
    TORCH_CHECK(max_depth >= 2, "SuffixIndex: max_depth must be >= 2, got ", max_depth);
    new_node(-1);  // the root
  }

  // append tokens to the text: each one's suffixes (lengths 1 .. max_depth) are counted once more
  void append(const std::vector<int64_t>& tokens) {
    std::vector<int32_t> next;
    for (const int64_t t : tokens) {
      next.clear();
      next.push_back(child_of(0, t));
      const size_t keep = std::min(active_.size(), size_t(max_depth_ - 1));
      for (size_t i = 0; i < keep; ++i) next.push_back(child_of(active_[i], t));
      for (const int32_t n : next) ++count_[n];
      if (next.size() > size_t(max_depth_ - 1)) next.resize(max_depth_ - 1);
      active_.swap(next);
    }
  }

  // the node of the longest suffix of context (at most max_match tokens) that occurred with a continuation, and
  // its length; (-1, 0) when none did
  std::tuple<int64_t, int64_t> match(const std::vector<int64_t>& context, int64_t max_match) const {
    int64_t best = -1, length = 0;
    const int64_t n = int64_t(context.size());
    const int64_t most = std::min({max_match, n, max_depth_ - 1});
    for (int64_t m = 1; m <= most; ++m) {
      int32_t node = 0;
      for (int64_t j = n - m; j < n && node >= 0; ++j) node = table_.find(node, context[j]);
      if (node < 0 || first_[node] < 0) break;
      best = node, length = m;
    }
    return {best, length};
  }

  // best-first continuations of node by path probability (a child's count over its siblings' total, multiplied
  // along the path), parents first; none below min_prob or deeper than max_depth: (tokens, parents, scores)
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>> draft(int64_t node, int64_t max_nodes,
                                                                                   double min_prob,
                                                                                   int64_t max_depth) const {
    TORCH_CHECK(node >= 0 && node < int64_t(count_.size()), "SuffixIndex.draft: no node ", node);
    struct Item {
      double score;
      int64_t seq, token, parent, depth;
      int32_t node;
    };
    auto later = [](const Item& a, const Item& b) { return a.score < b.score || (a.score == b.score && a.seq > b.seq); };
    std::priority_queue<Item, std::vector<Item>, decltype(later)> heap(later);
    int64_t seq = 0;
    auto push = [&](int32_t from, int64_t parent, double score, int64_t depth) {
      if (first_[from] < 0 || depth > max_depth) return;
      int64_t total = 0;
      for (int32_t c = first_[from]; c >= 0; c = next_[c]) total += count_[c];
      for (int32_t c = first_[from]; c >= 0; c = next_[c]) {
        const double s = score * double(count_[c]) / double(total);
        if (s >= min_prob) heap.push(Item{s, seq++, token_[c], parent, depth, c});
      }
    };
    std::vector<int64_t> tokens, parents;
    std::vector<double> scores;
    push(int32_t(node), -1, 1.0, 1);
    while (!heap.empty() && int64_t(tokens.size()) < max_nodes) {
      const Item it = heap.top();
      heap.pop();
      tokens.push_back(it.token);
      parents.push_back(it.parent);
      scores.push_back(it.score);
      push(it.node, int64_t(tokens.size()) - 1, it.score, it.depth + 1);
    }
    return {tokens, parents, scores};
  }

  int64_t num_nodes() const { return int64_t(count_.size()) - 1; }  // the root is not counted, as in Python

  int64_t memory_bytes() const {
    return int64_t(count_.size() * 5 * sizeof(int32_t) + table_.bytes() + active_.capacity() * sizeof(int32_t));
  }

 private:
  int32_t new_node(int64_t token) {
    const int32_t id = int32_t(count_.size());
    count_.push_back(0);
    first_.push_back(-1);
    last_.push_back(-1);
    next_.push_back(-1);
    token_.push_back(int32_t(token));
    return id;
  }

  int32_t child_of(int32_t parent, int64_t token) {
    int32_t c = table_.find(parent, token);
    if (c >= 0) return c;
    c = new_node(token);
    table_.insert(parent, token, c);
    if (last_[parent] < 0) first_[parent] = c;
    else next_[last_[parent]] = c;
    last_[parent] = c;
    return c;
  }

  int64_t max_depth_;
  std::vector<int32_t> count_, first_, last_, next_, token_;  // per node; children in creation order
  ChildTable table_;
  std::vector<int32_t> active_;  // the text's suffix nodes, shorter first
};

void bind_suffix_index(pybind11::module& m) {
  pybind11::class_<SuffixIndex>(m, "SuffixIndex", "one request's suffix trie (speculative/methods/suffix.py)")
      .def(pybind11::init<int64_t>())
      .def("append", &SuffixIndex::append, "append tokens to the indexed text")
      .def("match", &SuffixIndex::match, "(node, length) of the longest suffix that occurred with a continuation")
      .def("draft", &SuffixIndex::draft, "(tokens, parents, scores) of the best-first tree from a node")
      .def_property_readonly("num_nodes", &SuffixIndex::num_nodes)
      .def("memory_bytes", &SuffixIndex::memory_bytes);
}
