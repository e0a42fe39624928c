// DeepSeek's routing of a sparse layer (engine/worker/routing.py's Router.route defines it): the plain softmax top-k
// is moe.h's `route`; these are its options.
#pragma once

#include <algorithm>
#include <limits>
#include <utility>

#include "common.h"

namespace motet {

struct RouteOptions {
    bool sigmoid;  // each expert's sigmoid (V3), else the softmax over all experts (V2)
    int groups, kept;  // the choice limited to the `kept` best of `groups` groups of experts (1: no groups)
    const float* bias;  // V3's e_score_correction_bias [E] (fp32, for choosing only), or null
    float scale;  // routed_scaling_factor: the weights' factor
    bool renormalize;  // the chosen weights over their sum (+ 1e-20)
};

// The k largest of `queue`'s (value, index) pairs first, chosen as torch.topk chooses them on the CPU (moe.h's
// `route` does the same): nth_element then a sort of the first k - 1, or partial_sort where k * 64 <= n, NaN
// largest, so that exactly tied values pick the indices torch picks.
inline void select_top(std::vector<std::pair<float, int64_t>>& queue, int k) {
    const auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
    };
    if (static_cast<int64_t>(k) * 64 <= static_cast<int64_t>(queue.size())) {
        std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
    } else {
        std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
        std::sort(queue.begin(), queue.begin() + k - 1, larger);
    }
}

// A token's top-k experts and their weights from its E router logits (fp32): the scores (sigmoid or softmax); the
// choice the scores plus the bias; with groups, a group's score its best expert's choice (with the bias: its best
// two's sum), and the experts outside the kept groups ruled out (with the bias) or their choice zeroed (without,
// V2's); the top-k of the choice; their weights the scores (with the bias) or the choice, renormalized where the
// options say, times the scale. Where the kept groups hold fewer than k experts, the rest of the k are ruled-out
// ones, tied, picked as torch.topk picks them (transformers' routers do the same: V2's weigh 0, V3's their score).
inline void route_scored(const float* logits, int E, int k, const RouteOptions& o, int32_t* experts,
                         float* weights, std::vector<std::pair<float, int64_t>>& queue,
                         std::vector<float>& scores) {
    scores.resize(static_cast<size_t>(2) * E);
    float* score = scores.data();
    float* choice = score + E;
    if (o.sigmoid) {
        for (int e = 0; e < E; ++e) score[e] = sigmoid(logits[e]);
    } else {
        float mx = logits[0], sum = 0.0f;
        for (int e = 1; e < E; ++e) mx = logits[e] > mx ? logits[e] : mx;
        for (int e = 0; e < E; ++e) sum += (score[e] = std::exp(logits[e] - mx));
        for (int e = 0; e < E; ++e) score[e] /= sum;
    }
    for (int e = 0; e < E; ++e) choice[e] = score[e] + (o.bias ? o.bias[e] : 0.0f);
    if (o.groups > 1) {
        const int per = E / o.groups;
        queue.resize(o.groups);
        for (int gi = 0; gi < o.groups; ++gi) {
            const float* c = choice + gi * per;
            float best = c[0], second = -std::numeric_limits<float>::infinity();
            for (int e = 1; e < per; ++e) {
                if (c[e] > best) {
                    second = best;
                    best = c[e];
                } else if (c[e] > second) {
                    second = c[e];
                }
            }
            queue[gi] = {o.bias && per > 1 ? best + second : best, gi};
        }
        select_top(queue, o.kept);
        std::vector<bool> keep(o.groups, false);
        for (int j = 0; j < o.kept; ++j) keep[queue[j].second] = true;
        const float hidden = o.bias ? -std::numeric_limits<float>::infinity() : 0.0f;
        for (int e = 0; e < E; ++e)
            if (!keep[e / per]) choice[e] = hidden;
    }
    queue.resize(E);
    for (int e = 0; e < E; ++e) queue[e] = {choice[e], e};
    select_top(queue, k);
    float total = 0.0f;
    for (int j = 0; j < k; ++j) {
        const int e = static_cast<int>(queue[j].second);
        experts[j] = e;
        weights[j] = o.bias ? score[e] : choice[e];
        total += weights[j];
    }
    for (int j = 0; j < k; ++j) weights[j] = (o.renormalize ? weights[j] / (total + 1e-20f) : weights[j]) * o.scale;
}

}  // namespace motet
