// Suffix tries for suffix drafting (speculative/methods/suffix.py): occurrence counts of every substring of at most
// max_depth tokens of the indexed texts. Two uses: one request's prompt and output, extended token by token
// (append), and the engine's trie over recent requests' outputs, which texts join whole (add, naming their owner)
// and leave whole (remove, freeing the nodes whose count drops to zero). The same trie, the same match and the
// same best-first tree as the Python SuffixTrie (node for node, float for float): Python made ~23 objects per
// indexed token (~40 us each token), which on a 1,000-token prompt cost several decode steps, and the engine's
// trie held ~260 bytes a node in objects the garbage collector walks. Nodes live in flat arrays (freed ones
// reused); (parent, token) -> child in one open-addressing table; each node's children keep their creation order
// in a doubly linked sibling list, as a Python dict keeps insertion order through deletions.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <tuple>
#include <vector>

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

  // remove a present key, shifting later entries of its probe run back so that lookups stay correct
  void erase(int32_t parent, int64_t token) {
    const size_t mask = keys_.size() - 1;
    const uint64_t key = pack(parent, token);
    size_t i = slot(key);
    for (; keys_[i] != key; i = (i + 1) & mask) TORCH_CHECK(keys_[i] != kEmpty, "SuffixIndex: erasing an absent child");
    for (size_t j = (i + 1) & mask; keys_[j] != kEmpty; j = (j + 1) & mask) {
      const size_t home = slot(keys_[j]);
      // entry j may move to the hole at i unless its home lies cyclically in (i, j]
      if (((j - home) & mask) >= ((j - i) & mask)) {
        keys_[i] = keys_[j];
        vals_[i] = vals_[j];
        i = j;
      }
    }
    keys_[i] = kEmpty;
    --size_;
  }

  // room for n entries without growing (a table at most half full)
  void reserve(size_t n) {
    while (2 * n > keys_.size()) grow();
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
    // a prompt arrives whole into an empty trie: size the arrays and the table for its nodes at once instead of
    // growing them from nothing, rehashing the table at every doubling (450 tokens: 0.57 -> 0.30 ms). At most
    // max_depth nodes a token, and at most kReserveNodes: repetitive text makes far fewer, so a long prompt of
    // it must not hold memory for a bound it never reaches; growth past that doubles as before
    if (count_.size() == 1 && tokens.size() >= 64)
      reserve(std::min(kReserveNodes, 1 + tokens.size() * size_t(max_depth_)));
    extend(active_, tokens, 0);
  }

  // count one more whole text (owner: a serial number naming it, kept by every node it goes through)
  void add(const std::vector<int64_t>& tokens, int64_t owner) {
    std::vector<int32_t> active;
    extend(active, tokens, int32_t(owner));
  }

  // take back a text add counted: every substring's count drops by one; a node at zero is freed with its subtree
  void remove(const std::vector<int64_t>& tokens) {
    const size_t n = tokens.size();
    for (size_t i = 0; i < n; ++i) {
      int32_t node = 0;
      for (size_t j = i; j < std::min(n, i + size_t(max_depth_)); ++j) {
        const int32_t c = table_.find(node, tokens[j]);
        TORCH_CHECK(c >= 0, "SuffixIndex.remove: removing a text that was not added");
        if (--count_[c] == 0) {
          free_subtree(node, c);
          break;
        }
        node = c;
      }
    }
  }

  // the owner the latest text through node named (0: none)
  int64_t owner(int64_t node) const {
    TORCH_CHECK(node >= 0 && node < int64_t(count_.size()), "SuffixIndex.owner: no node ", node);
    return owner_[node];
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
  // along the path), parents first; none below min_prob or deeper than max_depth: (tokens, parents, scores, and
  // each one's trie node)
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, std::vector<int64_t>> draft(
      int64_t node, int64_t max_nodes, double min_prob, int64_t max_depth) const {
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
    std::vector<int64_t> tokens, parents, nodes;
    std::vector<double> scores;
    push(int32_t(node), -1, 1.0, 1);
    while (!heap.empty() && int64_t(tokens.size()) < max_nodes) {
      const Item it = heap.top();
      heap.pop();
      tokens.push_back(it.token);
      parents.push_back(it.parent);
      scores.push_back(it.score);
      nodes.push_back(it.node);
      push(it.node, int64_t(tokens.size()) - 1, it.score, it.depth + 1);
    }
    return {tokens, parents, scores, nodes};
  }

  // the root is not counted, as in Python
  int64_t num_nodes() const { return int64_t(count_.size() - free_.size()) - 1; }

  // bytes allocated: freed nodes' slots stay allocated for reuse, so this keeps the high-water mark
  int64_t memory_bytes() const {
    return int64_t(count_.capacity() * 7 * sizeof(int32_t) + table_.bytes() +
                   (active_.capacity() + free_.capacity()) * sizeof(int32_t));
  }

  // bytes the live nodes need: their 7 fields and two table slots each (the table grows at half full, so it holds
  // two to four slots a node)
  int64_t live_bytes() const { return (num_nodes() + 1) * int64_t(7 * sizeof(int32_t) + 2 * 12); }

 private:
  void extend(std::vector<int32_t>& active, const std::vector<int64_t>& tokens, int32_t owner) {
    std::vector<int32_t> next;
    for (const int64_t t : tokens) {
      next.clear();
      next.push_back(child_of(0, t));
      const size_t keep = std::min(active.size(), size_t(max_depth_ - 1));
      for (size_t i = 0; i < keep; ++i) next.push_back(child_of(active[i], t));
      for (const int32_t n : next) ++count_[n], owner_[n] = owner;
      if (next.size() > size_t(max_depth_ - 1)) next.resize(max_depth_ - 1);
      active.swap(next);
    }
  }

  void reserve(size_t nodes) {
    for (auto* v : {&count_, &first_, &last_, &next_, &prev_, &token_, &owner_}) v->reserve(nodes);
    table_.reserve(nodes);
  }

  int32_t new_node(int64_t token) {
    if (!free_.empty()) {
      const int32_t id = free_.back();
      free_.pop_back();
      count_[id] = 0, first_[id] = last_[id] = next_[id] = prev_[id] = -1, token_[id] = int32_t(token), owner_[id] = 0;
      return id;
    }
    const int32_t id = int32_t(count_.size());
    count_.push_back(0);
    first_.push_back(-1);
    last_.push_back(-1);
    next_.push_back(-1);
    prev_.push_back(-1);
    token_.push_back(int32_t(token));
    owner_.push_back(0);
    return id;
  }

  int32_t child_of(int32_t parent, int64_t token) {
    int32_t c = table_.find(parent, token);
    if (c >= 0) return c;
    c = new_node(token);
    table_.insert(parent, token, c);
    if (last_[parent] < 0) first_[parent] = c;
    else next_[last_[parent]] = c, prev_[c] = last_[parent];
    last_[parent] = c;
    return c;
  }

  // unlink child c of parent and free c's subtree
  void free_subtree(int32_t parent, int32_t c) {
    if (prev_[c] < 0) first_[parent] = next_[c];
    else next_[prev_[c]] = next_[c];
    if (next_[c] < 0) last_[parent] = prev_[c];
    else prev_[next_[c]] = prev_[c];
    table_.erase(parent, token_[c]);
    std::vector<int32_t> stack{c};
    while (!stack.empty()) {
      const int32_t x = stack.back();
      stack.pop_back();
      for (int32_t k = first_[x]; k >= 0; k = next_[k]) {
        table_.erase(x, token_[k]);
        stack.push_back(k);
      }
      free_.push_back(x);
    }
  }

  static constexpr size_t kReserveNodes = 32768;  // ~1.7 MB of arrays and table
  int64_t max_depth_;
  std::vector<int32_t> count_, first_, last_, next_, prev_, token_, owner_;  // per node; children in creation order
  std::vector<int32_t> free_;  // freed node ids, reused first
  ChildTable table_;
  std::vector<int32_t> active_;  // the text's suffix nodes, shorter first
};

void bind_suffix_index(pybind11::module& m) {
  pybind11::class_<SuffixIndex>(m, "SuffixIndex", pybind11::module_local(),
                              "a suffix trie over texts (speculative/methods/suffix.py)")
      .def(pybind11::init<int64_t>())
      .def("append", &SuffixIndex::append, "append tokens to the indexed text (one request's trie)")
      .def("add", &SuffixIndex::add, "count one more whole text, naming its owner")
      .def("remove", &SuffixIndex::remove, "take back a text add counted (nodes at zero freed)")
      .def("owner", &SuffixIndex::owner, "the owner the latest text through a node named")
      .def("match", &SuffixIndex::match, "(node, length) of the longest suffix that occurred with a continuation")
      .def("draft", &SuffixIndex::draft, "(tokens, parents, scores, nodes) of the best-first tree from a node")
      .def_property_readonly("num_nodes", &SuffixIndex::num_nodes)
      .def("memory_bytes", &SuffixIndex::memory_bytes, "bytes allocated (the high-water mark)")
      .def("live_bytes", &SuffixIndex::live_bytes, "bytes the live nodes need");
}
