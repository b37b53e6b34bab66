# The clusterAllocator example of seed 000 ("Writing cluster allocator policy" -> "Example"),
# as written there. Only PDF-extraction damage is repaired: the docstring quotes, the
# indentation of the post_dry_run branch and the except clause, and `filter result` ->
# `filter_result` in the empty-filter check.
class ClusterSelectorPolicyRule:
    def __init__(self, rule_id, settings, parameters):
        # Initialize the policy with rule ID, configuration settings, and external parameter
        self.rule_id = rule_id
        self.settings = settings
        self.parameters = parameters

    def eval(self, parameters, input_data, context):
        """
        Evaluates the cluster allocator policy based on the action phase.
        Supported actions:
        - "selection": Select clusters after filtering (could be all or a subset).
        - "post_dry_run": Select a single cluster based on feasibility scores.
        """
        try:
            # Action: selection
            if input_data['action'] == "selection":
                print(parameters, input_data, context)
                # Retrieve filtered cluster candidates from the filter step.
                filter_result = input_data['filter_result']
                if len(filter_result) == 0:
                    raise Exception("no results found in the filter")
                result = {}
                # Optionally apply custom filtering or ranking logic here
                # Currently, returns all filtered clusters as-is
                result['clusters'] = filter_result
                return result
            # Action: post_dry_run
            if input_data['action'] == "post_dry_run":
                selected_clusters = input_data['clusters']
                # Select the cluster with the highest feasibility score from dry_run
                highest_index = 0
                current_highest = -1
                idx = 0
                for entry in selected_clusters:
                    score_data = entry["score_data"]
                    if score_data['score'] > current_highest:
                        current_highest = score_data['score']
                        highest_index = idx
                    idx += 1
                # Return the cluster with the highest score
                return selected_clusters[highest_index]
        except Exception as e:
            # Bubble up exception for the caller to handle
            raise e
